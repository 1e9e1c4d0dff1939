"""The learner: ``collect a batch → train → acknowledge → publish → evaluate → record``, until ``run.steps``.

Policy versions: version v is the policy after v learner steps; version 0 is ``model.path``. Actors stamp each group
with the version they sampled it with, and a group is trained at most ``max_staleness`` versions later. Each step is
one of the learner's parts: learner.intake (reading, refusing and aligning groups), learner.trainer (the optimisation,
no I/O), learner.publishing (versions written or broadcast, and announced), learner.evaluation, learner.record
(metrics.jsonl, Prometheus, trackers, alarms) and learner.identity (the run in Redis); this module runs the steps in
order, checkpoints and resumes; learner.process starts the process around it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from common.config import Config
from common.liveness import Liveness
from common.metrics import LearnerMetrics
from common.model.generation import pad_token_id, stop_token_ids
from common.rollout import SampleGrader
from common.transport import LearnerTransport
from learner import checkpoint
from learner.distributed import Ranks
from learner.evaluation import Evaluator
from learner.identity import RunClaim
from learner.intake import Collected, Intake
from learner.progress import Progress
from learner.publishing import Publisher
from learner.record import Record
from learner.trainer import Trainer

log = logging.getLogger("learner")


class Learner:
    def __init__(
        self,
        cfg: Config,
        transport: LearnerTransport | None,
        model: Any,
        tokenizer: Any,
        grader: SampleGrader,
        metrics: LearnerMetrics,
        reference: Any = None,
        ranks: Ranks | None = None,
        stop: threading.Event | None = None,
        liveness: Liveness | None = None,
    ):
        self.cfg = cfg
        self.liveness = liveness or Liveness(cfg.metrics.stall_after_s)  # the loop's beats, for /healthz
        # Under torchrun every rank runs this loop; rank 0 alone uses Redis and writes files, the others follow it
        # through broadcasts (learner.distributed) and have no transport.
        self.ranks = ranks
        self.is_rank0 = ranks is None or ranks.is_rank0
        self.transport = cast(LearnerTransport, transport)
        # The lease token this learner holds the run with (learner.lease): its checkpoints and versions carry it.
        self.lease_token = transport.lease_token() if transport is not None else 0
        self.model = model
        self.metrics = metrics
        self.stop = stop or threading.Event()  # set by SIGTERM/SIGINT (see _lead)
        self.progress = Progress()
        stop_ids = stop_token_ids(model, tokenizer)
        pad_id = pad_token_id(tokenizer, stop_ids)
        self.trainer = Trainer(cfg, model, pad_id, reference, ranks)
        self.evaluator = Evaluator(
            cfg, model, tokenizer, grader, metrics, stop_ids, pad_id, self.trainer.autocast, self.trainer.cores
        )
        # Where the learner stands is the loop's: each part is handed it by the call that reads or moves it.
        self.publisher = Publisher(cfg, self.transport, model, tokenizer, metrics, ranks)
        self.identity = RunClaim(cfg, self.transport, self.publisher)
        waiting = functools.partial(self.liveness.beat, "waiting for groups")  # at each read: slow actors are no stall
        self.intake = Intake(cfg, self.transport, model, metrics, self.identity, ranks, self.stop, waiting)
        self.record = Record(cfg, self.transport, metrics, self.is_rank0)

    # -- the loop -----------------------------------------------------------------------------------------------

    def run(self) -> int:
        self.start()
        steps = self.cfg.run.steps
        if self.is_rank0 and self.progress.step >= steps:  # `docker compose up` again after the run's end
            log.info("run %s has trained its %d steps already (its checkpoint is at step %d): nothing to do. For a new "
                     "run give it another run.name (GRPO_RUN_NAME); to go on with this one, raise run.steps",
                     self.cfg.run.name, steps, self.progress.step)  # fmt: skip
        last = time.perf_counter()
        while self.progress.step < steps:
            self.liveness.beat("waiting for groups", step=self.progress.step, version=self.progress.version)
            batch = self.intake.collect(self.progress)
            if batch is None:
                self.checkpoint()
                log.info("stopped at step %d of %d (asked to stop); checkpoint written", self.progress.step, steps)
                return 0
            last = self.train_step(batch, last)
        if self.is_rank0:
            self.transport.mark_done()
            log.info("finished %d steps in %.1fs; %d groups trained", steps,
                     time.perf_counter() - self.record.started, self.progress.groups_consumed)  # fmt: skip
        return 0

    def start(self) -> None:
        """Join the stream, take up the run (its identity, and what an earlier learner left pending), publish the
        version the learner starts (or resumes) from, and record step 0 when the run is fresh."""
        self.liveness.beat("taking up the run", starting=True)
        if self.is_rank0:
            self.transport.ensure_consumer_group()
        # The run's identity is checked before anything in Redis is touched (resume acknowledges what its checkpoint
        # covers): a learner pointed at another run's Redis must change nothing there.
        resumed = self.resume()
        if self.is_rank0:
            if not resumed:
                self.identity.claim(self.progress)
            taken = self.transport.claim_pending(self.intake.consumer)  # read by an earlier learner, never settled
            if taken:
                log.info("took over %d groups an earlier learner had read and not settled", len(taken))
            # The next row is step 0, or the one after the checkpoint.
            self.record.open_trackers(self.progress.run_id, self.progress.step + 1 if resumed else 0)
        self.publisher.continue_versions(self.progress)
        if self.is_rank0:
            self.transport.clear_done()  # (re)started to train: actors must not stop
        self.publish()  # actors align with the version the learner starts (or resumes) from
        if not resumed:
            if self.is_rank0:
                self.record.truncate(-1)  # rows of an earlier attempt that never checkpointed: trained again
            self.liveness.beat("evaluating")
            self.record.write({"step": 0, "policy_version": self.progress.version, **self.evaluator.evaluate()})

    def train_step(self, batch: Collected, last: float) -> float:
        """Train on ``batch``, then publish, evaluate, record and checkpoint as configured; returns when it ended
        (``last``: when the previous step ended)."""
        p, steps = self.progress, self.cfg.run.steps
        self.liveness.beat(f"training step {p.step + 1}")
        t_train = time.perf_counter()
        stats = self.trainer.step(batch.groups, p.version, batch.filtered)
        pad = self.cfg.learner.min_step_s - (time.perf_counter() - t_train)
        if pad > 0:  # benchmarks: a step of controlled time (learner.min_step_s)
            self.stop.wait(pad)
        self.settle(batch, stats)
        p.step += 1
        p.version += 1  # equal to the step, unless a resume skipped versions (see Publisher.continue_versions)
        stats["time/train_s"] = time.perf_counter() - t_train
        self.still_holding()  # before this step's files: a learner that lost the run writes none
        if p.step % self.cfg.learner.publish_every == 0 or p.step == steps:
            stats |= self.publish()
        if p.step % self.cfg.learner.eval_every == 0 or p.step == steps:
            self.liveness.beat("evaluating", step=p.step, version=p.version)
            stats |= self.evaluator.evaluate()
        if self.is_rank0:
            stats |= self.record.stream_figures()
        now = time.perf_counter()
        stats |= {"time/step_s": now - last, "time/wait_s": batch.wait_s}
        row = self.record.metrics_row(stats, p)
        self.still_holding()  # an evaluation may have taken long: the row is the run's only while this learner holds it
        self.record.write(row)
        # After the row: a checkpoint must never cover a step whose row was not written (a learner killed in
        # between would resume past it and the row would be lost; killed before, it retrains the step).
        if p.step % self.cfg.checkpoint.every == 0 or p.step == steps:
            self.checkpoint()
        if self.is_rank0:
            self.record.log_progress(row)
            self.record.raise_alarms(row)
        return now

    def publish(self) -> dict[str, float]:
        p = self.progress
        self.liveness.beat(f"publishing version {p.version}")
        return self.publisher.publish(p.version, p.lineage.current.epoch, last=p.step == self.cfg.run.steps)

    def still_holding(self) -> None:
        """One round trip before the learner writes files: :class:`LeaseLost` if another learner took the run over
        (Redis refuses its writes anyway; this keeps its files out of the run too, but for an instant's race, which
        learner.fencing covers)."""
        if self.is_rank0 and self.lease_token:
            self.transport.renew_lease()

    def settle(self, batch: Collected, stats: dict[str, float]) -> None:
        """The step's groups are trained, and acknowledged by the checkpoint that covers the step, unless none of
        its updates could be applied (every gradient non-finite, see learner.trainer): the policy learnt nothing
        from them, so they are dropped now as ``nonfinite``, not counted as trained; the step still counts, and its
        row says ``updates_skipped_nonfinite`` and a null loss."""
        p = self.progress
        skipped = int(stats.get("updates_skipped_nonfinite", 0))
        self.metrics.updates_skipped.inc(skipped)
        if skipped < self.cfg.learner.updates_per_batch:
            p.window_ids += batch.ids
            p.window_groups += [g.group_id for g in batch.groups]
            p.window_positions += [-1 if g.position is None else g.position for g in batch.groups]
            p.groups_consumed += len(batch.ids)
            self.metrics.groups_consumed.inc(len(batch.ids))
            return
        log.warning("step %d: every update was non-finite and none was applied; its %d groups are dropped as "
                    "nonfinite", p.step + 1, len(batch.ids))  # fmt: skip
        if self.is_rank0:
            self.transport.drop(batch.ids, "nonfinite")
        p.count_dropped("nonfinite", len(batch.ids), self.metrics)

    # -- checkpoints --------------------------------------------------------------------------------------------

    def checkpoint(self) -> dict[str, float]:
        """Write the learner's whole state, then acknowledge the groups it covers (see learner.checkpoint)."""
        p = self.progress
        if p.step == p.checkpointed_step and not p.window_ids:
            return {}
        self.liveness.beat("writing a checkpoint")
        if self.is_rank0:  # the rows of the steps it covers reach the disk before it does (see train_step)
            self.record.sync()
        t0 = time.perf_counter()
        cc, t = self.cfg.checkpoint, self.trainer
        self.still_holding()
        state = replace(p.resumable(), lease_token=self.lease_token)
        checkpoint.save(
            cc.dir, state, self.model, t.optimizer, t.scheduler, t.generator, cc.keep, self.ranks, self.publisher.base
        )
        if self.is_rank0:
            self.transport.ack_trained(p.window_ids, p.window_groups, p.step, cc.dedup_window, p.window_positions)
        p.window_ids, p.window_groups, p.window_positions = [], [], []
        p.checkpointed_step = p.step
        seconds = time.perf_counter() - t0
        self.metrics.checkpoint_seconds.observe(seconds)
        self.metrics.checkpoint_step.set(p.step)
        return {"time/checkpoint_s": seconds}

    def resume(self) -> bool:
        """Continue from the newest checkpoint, if there is one: weights, optimizer, schedule, RNG, step and version
        (so published versions continue their sequence). Groups it covers are acknowledged first; groups trained
        after it were never acknowledged and are read again."""
        path = checkpoint.latest(self.cfg.checkpoint.dir) if self.is_rank0 else None
        if self.ranks is not None:  # the one rank 0 found, whatever the others' view of the directory
            chosen = self.ranks.broadcast(None if path is None else str(path))
            path = None if chosen is None else Path(chosen)
        if path is None:
            return False
        t = self.trainer
        r = checkpoint.load(path, self.model, t.optimizer, t.scheduler, t.generator, self.ranks, self.publisher.base)
        self.progress.restore(r)
        self.metrics.checkpoint_step.set(r.step)
        if not self.is_rank0:
            return True
        self.identity.claim(self.progress)
        self.transport.ack_trained(r.covers, r.covers_groups, r.step, self.cfg.checkpoint.dedup_window,
                                   r.covers_positions)  # fmt: skip
        self.record.truncate(r.step)
        log.info("resumed from %s: step %d, policy version %d", path, r.step, r.version)
        return True

    def close(self) -> None:
        self.record.close()
        self.publisher.close()
        self.evaluator.close()
