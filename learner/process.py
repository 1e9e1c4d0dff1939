"""The learner process: its models loaded, its Redis, lease, metrics server and grader opened, the
:class:`learner.loop.Learner` run until it stops, and everything closed again; under torchrun, rank 0 leads (Redis,
files, metrics) and the other ranks follow it."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from common.config import Config, ConfigError, write_resolved
from common.liveness import Liveness
from common.metrics import LearnerMetrics, MetricsServer, process_registry, register_endpoint
from common.model.importing import prepare_model_path
from common.model.loading import load_pretrained
from common.model.lora import peft_config, wrap
from common.tasks.evaluation import correctness
from common.transport import LearnerTransport
from grader.open import open_grader
from learner import checkpoint
from learner.distributed import Ranks
from learner.lease import RunLease
from learner.loop import Learner
from learner.publishing import newest_published
from learner.record import take_over_rows
from learner.trackers import check_trackers
from learner.trainer import disable_dropout

log = logging.getLogger("learner")


def load_models(cfg: Config, device: str | None = None) -> tuple[Any, Any, Any]:
    """Tokenizer, policy, and the frozen reference policy — loaded only when beta > 0, else None. With
    ``learner.lora`` the policy is the base with a fresh adapter, and there is no second copy: the reference is the
    policy with its adapter switched off (learner.trainer)."""
    device = device or cfg.model.device
    tokenizer, model = load_pretrained(cfg.model.path, cfg.model.dtype, device)
    disable_dropout(model)  # the base's own dropout; the adapter's (lora.dropout) is added after, as configured
    lc = cfg.learner
    if lc.lora.rank:
        config = peft_config(lc.lora.rank, lc.lora.alpha, lc.lora.dropout, lc.lora.target_modules)
        return tokenizer, wrap(model, config).eval(), None  # (peft adds its layers in training mode)
    reference = None
    if lc.beta > 0:
        reference = load_pretrained(cfg.model.path, cfg.model.dtype, device)[1].requires_grad_(False)
    return tokenizer, model, reference


def run_learner(cfg: Config) -> int:
    check_trackers(cfg.run.trackers)  # a missing package: one line and exit 2 before anything loads
    torch.set_num_threads(cfg.learner.torch_threads)
    torch.manual_seed(cfg.run.seed)
    prepare_model_path(cfg)
    ranks = Ranks.from_env(cfg.model.device)  # under torchrun: this process's rank, its device
    try:
        if ranks is not None:
            lc = cfg.learner
            if lc.lora.rank:  # FSDP2 sharding of a peft model, and gathering its adapter alone, are not built
                raise ConfigError(
                    f"config error: learner.lora.rank: LoRA trains in one learner process, not under torchrun "
                    f"({ranks.world} ranks); set learner.lora.rank to 0 or start one process"
                )
            smallest = lc.batch_groups * cfg.sampling.group_size // (lc.updates_per_batch * lc.grad_accum)
            if smallest < ranks.world:  # every rank needs rows of every micro-batch (one forward each)
                raise ConfigError(
                    f"config error: learner.batch_groups: micro-batches of {smallest} completions cannot be split "
                    f"over {ranks.world} ranks; raise learner.batch_groups or lower updates_per_batch x grad_accum"
                )
        if ranks is not None and not ranks.is_rank0:
            logging.getLogger().setLevel(logging.WARNING)  # rank 0 speaks for the learner
            return _follow(cfg, ranks)
        return _lead(cfg, ranks)
    finally:
        if ranks is not None:
            ranks.close()


def _models(cfg: Config, ranks: Ranks | None) -> tuple[Any, Any, Any]:
    tokenizer, model, reference = load_models(cfg, ranks.device if ranks is not None else None)
    if ranks is not None:  # every rank loads the model once, then keeps its shards
        model = ranks.shard(model)
        reference = ranks.shard(reference) if reference is not None else None
    return tokenizer, model, reference


def _follow(cfg: Config, ranks: Ranks) -> int:
    """A rank other than 0: no Redis, no files, no metrics server; it trains, evaluates and gathers with rank 0."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when to stop and tells the others
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open_grader(correctness(cfg.grader)) as grader:  # the learner grades only its evaluation
        tokenizer, model, reference = _models(cfg, ranks)
        metrics = LearnerMetrics(CollectorRegistry())
        return Learner(cfg, None, model, tokenizer, grader, metrics, reference, ranks).run()


def _lead(cfg: Config, ranks: Ranks | None) -> int:
    registry = process_registry(cfg.run.name)
    metrics = LearnerMetrics(registry)
    metrics.run_steps.set(cfg.run.steps)
    transport = LearnerTransport(
        cfg.redis, cfg.run.name, on_error=metrics.errors.inc, on_reconnect=metrics.reconnects.inc
    )
    transport.ping()
    # The run is this learner's before it writes anything of it: a second learner waits (or exits) here.
    lease = RunLease(cfg, transport, stop := threading.Event())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # /healthz: the loop's beats within metrics.stall_after_s (common.liveness), served while the learner waits for
    # the run's lease too: waiting (learner.if_held wait, up to learner.held_wait_s) is alive, not hung.
    liveness = Liveness(cfg.metrics.stall_after_s, role="learner", step=0, version=None)
    server = MetricsServer(registry, cfg.metrics.host, cfg.metrics.port, liveness.report)
    try:
        liveness.beat("waiting for the run's lease", cfg.learner.held_wait_s + cfg.metrics.stall_after_s, starting=True)
        if not lease.take():
            log.info("stopped while waiting for run %s", cfg.run.name)
            return 0
        return _hold(cfg, ranks, transport, metrics, lease, stop, server, liveness)
    finally:
        server.close()
        lease.release()
        transport.close()


def _hold(
    cfg: Config,
    ranks: Ranks | None,
    transport: LearnerTransport,
    metrics: LearnerMetrics,
    lease: RunLease,
    stop: threading.Event,
    server: MetricsServer,
    liveness: Liveness,
) -> int:
    """The run is held: mark it (learner.fencing), keep the lease from a thread, and train."""
    made = not Path(cfg.run.dir).exists()  # a start refused on the user's input removes the directory it made
    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    base = checkpoint.latest(cfg.checkpoint.dir)
    marker = lease.mark(checkpoint.step_of(base), newest_published(cfg, transport))
    lease.keep()
    if ranks is None or ranks.is_rank0:  # replaced now, not once the model is loaded (learner.record)
        take_over_rows(Path(cfg.run.dir) / "metrics.jsonl", -1 if base is None else checkpoint.step_of(base),
                       only_if_there=True)  # fmt: skip
    write_resolved(cfg, Path(cfg.run.dir) / "config.json")
    lc = cfg.learner
    log.info("loss %s, eps %.2f/%.2f, lr %g, %d groups x %d per step; %s%s", lc.loss_type, lc.epsilon_low,
             lc.epsilon_high, lc.lr, lc.batch_groups, cfg.sampling.group_size, _kl_line(cfg),
             f"; FSDP2 over {ranks.world} ranks" if ranks is not None else "")  # fmt: skip
    learner: Learner | None = None
    grader = open_grader(correctness(cfg.grader))  # the learner grades only its evaluation: right or wrong
    endpoint = register_endpoint(cfg.run.dir, "learner", "learner", server.url)
    try:
        liveness.beat("loading the model", starting=True)
        tokenizer, model, reference = _models(cfg, ranks)
        metrics.reference_loaded.set(int(reference is not None))
        learner = Learner(cfg, transport, model, tokenizer, grader, metrics, reference, ranks, stop, liveness)
        log.info("learner: %d steps, metrics on %s, run dir %s", cfg.run.steps, server.listening, cfg.run.dir)
        return learner.run()
    except ConfigError:
        if made and learner is None:  # refused before training (the task, the chat template): nothing is left
            _unmake_run_dir(Path(cfg.run.dir), [Path(cfg.run.dir) / "config.json", endpoint, marker])
        raise
    finally:
        if learner is not None:
            learner.close()
        grader.close()


def _kl_line(cfg: Config) -> str:
    lc = cfg.learner
    lora = (f"LoRA rank {lc.lora.rank}, alpha {lc.lora.alpha:g} on {lc.lora.target_modules}; " if lc.lora.rank
            else "")  # fmt: skip
    if lc.beta <= 0:
        return lora + "KL penalty off (beta = 0): no reference model is loaded"
    return lora + f"KL penalty beta={lc.beta}" + (" (the reference: the adapter switched off)" if lc.lora.rank else "")


def _unmake_run_dir(run_dir: Path, files: list[Path]) -> None:
    """Remove what a refused start wrote in the run directory it made (config.json, its endpoint, its holder marker),
    then the directories they are in and the run directory itself once empty: rmdir only, so anything another
    process wrote there stays."""
    for f in files:
        f.unlink(missing_ok=True)
    for d in [*(p for f in files for p in f.parents if p.is_relative_to(run_dir) and p != run_dir), run_dir]:
        with contextlib.suppress(OSError):
            d.rmdir()
