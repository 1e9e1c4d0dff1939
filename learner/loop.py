"""The learner: ``collect a batch → train → acknowledge → publish → evaluate → record``, until ``run.steps``.

Policy versions: version v is the policy after v learner steps; version 0 is ``model.path``. Actors stamp each group
with the version they sampled it with, and a group is trained at most ``max_staleness`` versions later.

Departures from the textbook, each a config choice (see learner.loss for the loss itself):
- old log-probs are by default the learner's own, computed without grad at the start of the step (AReaL's decoupled
  PPO: the clip then bounds the move from the *current* policy, not from whichever stale copy an actor used), and
  the behaviour policy is corrected for with the truncated importance weight min(π_prox / π_behaviour, C);
- each batch is split into ``minibatches`` shuffled parts with one AdamW step each.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from common.config import Config, check_model_path, write_resolved
from common.generation import generate, pad_token_id, stop_token_ids
from common.grpo import group_advantages, token_logprobs
from common.metrics import LearnerMetrics, MetricsServer, register_endpoint
from common.models import load_pretrained
from common.schemas import GroupMessage, SchemaError, decode_group
from common.tasks import make_task
from common.transport import StreamEntry, Transport
from common.weights import publish
from grader.pool import GraderPool, open_grader
from learner.batch import Batch, assemble, sampled_reward_stats
from learner.loss import grpo_loss

log = logging.getLogger("learner")


@dataclass
class Collected:
    ids: list[str]
    groups: list[GroupMessage]
    wait_s: float


class Learner:
    def __init__(
        self,
        cfg: Config,
        transport: Transport,
        model: Any,
        tokenizer: Any,
        grader: GraderPool,
        metrics: LearnerMetrics,
        reference: Any = None,
    ):
        self.cfg = cfg
        # The frozen starting policy for the KL penalty; it exists only when beta > 0 (no memory spent otherwise).
        self.reference = reference
        self.transport = transport
        self.model = model
        self.tokenizer = tokenizer
        self.grader = grader
        self.metrics = metrics
        self.task = make_task(cfg.task.name, cfg.task.eval_size, cfg.run.seed)
        lc = cfg.learner
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lc.lr, betas=lc.betas, weight_decay=lc.weight_decay)
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.pad_id = pad_token_id(tokenizer, self.stop_ids)
        self.device = next(model.parameters()).device
        self.consumer = f"learner-{socket.gethostname()}-{os.getpid()}"
        self.version = 0
        self.step = 0
        self.groups_consumed = 0
        self.dropped: Counter[str] = Counter()
        self.dead = 0
        self.stop = threading.Event()
        self.metrics_path = Path(cfg.run.dir) / "metrics.jsonl"
        self._generator = torch.Generator().manual_seed(cfg.run.seed)
        self._started = time.perf_counter()

    # -- the loop -----------------------------------------------------------------------------------------------

    def run(self) -> int:
        self.transport.ensure_consumer_group()
        taken = self.transport.claim_pending(self.consumer)  # read by an earlier learner, never settled
        if taken:
            log.info("took over %d groups an earlier learner had read and not trained on", len(taken))
        self.transport.clear_done()  # a finished earlier run under this name must not stop today's actors
        self.publish()  # actors align with the version the learner starts from
        self.record({"step": 0, "policy_version": self.version, **self.evaluate()})
        steps = self.cfg.run.steps
        last = time.perf_counter()
        while self.step < steps:
            batch = self.collect()
            if batch is None:
                log.info("stopping at step %d of %d (asked to stop)", self.step, steps)
                return 0
            t_train = time.perf_counter()
            stats = self.train(batch.groups)
            self.transport.ack_trained(batch.ids)  # only now: the optimizer step that used them is done
            self.groups_consumed += len(batch.ids)
            self.metrics.groups_consumed.inc(len(batch.ids))
            self.step += 1
            self.version = self.step
            stats["time/train_s"] = time.perf_counter() - t_train
            if self.step % self.cfg.learner.publish_every == 0 or self.step == steps:
                stats |= self.publish()
            if self.step % self.cfg.learner.eval_every == 0 or self.step == steps:
                stats |= self.evaluate()
            now = time.perf_counter()
            stats |= {"time/step_s": now - last, "time/wait_s": batch.wait_s}
            last = now
            self.record(self.describe(stats))
        self.transport.mark_done()
        log.info(
            "finished %d steps in %.1fs; %d groups trained",
            steps,
            time.perf_counter() - self._started,
            self.groups_consumed,
        )
        return 0

    # -- steps --------------------------------------------------------------------------------------------------

    def collect(self) -> Collected | None:
        """Read until ``batch_groups`` usable groups: a message that fails to decode is dead-lettered, a group too
        far behind (or ahead of) the learner's version is dropped, both counted in Redis with their reason."""
        want = self.cfg.learner.batch_groups
        ids: list[str] = []
        groups: list[GroupMessage] = []
        t0 = time.perf_counter()
        next_notice = t0 + 30
        # Nothing of ours is in flight between steps, so whatever is pending for this consumer now was stranded
        # (taken over at start, or read by a command whose reply was lost): it comes first.
        pending_after: str | None = "0"
        while len(groups) < want:
            if self.stop.is_set():
                return None
            asked = want - len(groups)
            entries = self.transport.read(
                self.consumer, asked, self.cfg.learner.read_block_ms, pending_after=pending_after
            )
            if pending_after is not None:  # stranded entries first, then new ones once they run out
                pending_after = entries[-1].id if len(entries) == asked else None
            drops: dict[str, list[str]] = {}
            for entry in entries:
                msg = self.decode(entry)
                if msg is None:
                    continue
                reason = self.refusal(msg)
                if reason:
                    drops.setdefault(reason, []).append(entry.id)
                else:
                    ids.append(entry.id)
                    groups.append(msg)
            for reason, dropped in drops.items():
                self.transport.drop(dropped, reason)
                self.dropped[reason] += len(dropped)
                self.metrics.groups_dropped.labels(reason).inc(len(dropped))
            if time.perf_counter() > next_notice:
                next_notice += 30
                log.info("waiting for groups: %d of %d after %.0fs", len(groups), want, time.perf_counter() - t0)
        return Collected(ids, groups, time.perf_counter() - t0)

    def decode(self, entry: StreamEntry) -> GroupMessage | None:
        """The group, or None after dead-lettering a message that is malformed or does not fit this model."""
        try:
            if entry.payload is None:
                raise SchemaError("stream entry has no 'data' field")
            msg = decode_group(entry.payload)
            self.check_fits(msg)
            return msg
        except SchemaError as e:
            log.warning("dead-lettering %s: %s", entry.id, e)
            self.transport.dead_letter(entry, str(e))
            self.dead += 1
            self.metrics.groups_dead.inc()
            return None

    def check_fits(self, msg: GroupMessage) -> None:
        """Token ids the embedding does not have, or sequences longer than the model's positions, would crash a
        forward pass: such a message is as malformed as bad msgpack."""
        vocab = self.model.get_input_embeddings().num_embeddings
        longest = getattr(self.model.config, "max_position_embeddings", None)
        for c in msg.completions:
            top = max(int(msg.prompt_ids.max()), int(c.token_ids.max()))
            if top >= vocab:
                raise SchemaError(f"token id {top} outside the model's vocabulary of {vocab}")
            if longest is not None and len(msg.prompt_ids) + len(c.token_ids) > longest:
                raise SchemaError(f"{len(msg.prompt_ids) + len(c.token_ids)} tokens exceed the model's {longest}")

    def refusal(self, msg: GroupMessage) -> str | None:
        """Why a valid group cannot be trained on now, or None."""
        if len(msg.completions) != self.cfg.actor.group_size:
            return "group_size"
        staleness = self.version - msg.policy_version
        # Too old: the importance ratio against a policy this far behind is no longer a small correction.
        if staleness > self.cfg.learner.max_staleness:
            return "stale"
        # From a version this learner has not reached (a learner restarted without its checkpoint).
        if staleness < 0:
            return "future"
        return None

    def train(self, groups: list[GroupMessage]) -> dict[str, float]:
        """One learner step on a batch: advantages → old log-probs → mini-batch updates → statistics."""
        batch = assemble(groups, self.pad_id, self.version).to(self.device)
        adv = self.advantages(batch)
        old, is_weights, seen = self.old_logprobs(batch)
        ref = self._scored(self.reference, batch)[0] if self.reference is not None else None
        sums, first = self.update(batch, adv, old, is_weights, ref)
        seen = seen or first  # behaviour mode: what the policy looked like, from the first mini-batch
        stats: dict[str, float] = {k: v / sums["updates"] for k, v in sums.items() if k != "updates"}
        stats |= sampled_reward_stats(groups)
        stats |= seen
        stats |= {
            "completions/mean_length": float(batch.completion_lengths.mean()),
            "completions/truncated_frac": float(batch.truncated.float().mean()),
            "staleness/mean": float(batch.staleness.float().mean()),
            "staleness/max": float(batch.staleness.max()),
            "groups_forwarded_zero_std": float(sum(g.zero_std for g in groups)),
            "tokens": float(batch.loss_mask.sum()),
        }
        if is_weights is not None:
            w = is_weights[batch.loss_mask > 0]
            stats |= {
                "is_weight/mean": float(w.mean()),
                "is_weight/max": float(w.max()),
                "is_weight/truncated_frac": float((w >= self.cfg.learner.tis_cap).float().mean()),
            }
        return stats

    def advantages(self, batch: Batch) -> torch.Tensor:
        a = self.cfg.learner.advantage
        rewards = batch.rewards
        if self.cfg.run.shuffle_rewards:  # the control experiment: rewards no longer belong to their completions
            perm = torch.randperm(len(rewards), generator=self._generator).to(rewards.device)
            rewards = rewards[perm]
        return group_advantages(rewards, batch.group_size, scale=a.scale, ddof=a.ddof, eps=a.eps).float()

    def old_logprobs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """The ratio's denominator, the importance weights, and (proximal mode) entropy and engine mismatch."""
        lc = self.cfg.learner
        if lc.old_logprobs == "behavior":
            # One forward pass cheaper: the ratio is taken against the engine's log-probs directly.
            return batch.behaviour_logprobs, None, {}
        prox, seen = self._scored(self.model, batch)
        # Truncated importance sampling (AReaL): the tokens were sampled by the behaviour policy, not the proximal
        # one, so each token's loss is weighted by min(π_prox / π_behaviour, C); the cap bounds the variance.
        log_ratio = (prox - batch.behaviour_logprobs) * batch.loss_mask
        return prox, torch.clamp(torch.exp(log_ratio), max=lc.tis_cap), seen

    def update(
        self,
        batch: Batch,
        adv: torch.Tensor,
        old: torch.Tensor,
        is_weights: torch.Tensor | None,
        ref: torch.Tensor | None,
    ) -> tuple[Counter[str], dict[str, float]]:
        """``minibatches`` shuffled AdamW steps over the batch. Returns summed metrics and what the first
        mini-batch's forward pass saw (the policy before any of this step's updates)."""
        lc, temp, mask = self.cfg.learner, self.cfg.sampling.temperature, batch.loss_mask
        sums: Counter[str] = Counter()
        first: dict[str, float] = {}
        order = torch.randperm(len(batch.rewards), generator=self._generator).to(self.device)
        self.model.train()
        for rows in (c for c in order.chunk(lc.minibatches) if len(c)):
            logits = self.model(input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows]).logits
            logprobs = token_logprobs(logits[:, :-1], batch.input_ids[rows, 1:], temp)
            if not first:
                first = _observed(logits[:, :-1].detach(), batch, rows, temp)[1]
            loss, m = grpo_loss(
                logprobs,
                old[rows],
                adv[rows],
                mask[rows],
                loss_type=lc.loss_type,
                epsilon_low=lc.epsilon_low,
                epsilon_high=lc.epsilon_high,
                beta=lc.beta,
                ref_logprobs=None if ref is None else ref[rows],
                max_completion_length=self.cfg.sampling.max_new_tokens,
                is_weights=None if is_weights is None else is_weights[rows],
                num_tokens=mask[rows].sum(),  # one optimizer step per mini-batch: its own token count
            )
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), lc.grad_clip)
            self.optimizer.step()
            sums.update({"loss": loss.item(), "grad_norm": grad_norm.item(), "updates": 1, **m})
        self.model.eval()
        return sums, first

    @torch.no_grad()
    def _scored(self, model: Any, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Log-probs of the batch's tokens under ``model`` in eval mode (no grad; 0 outside the mask), with the
        mean token entropy and the engine-vs-learner mismatch they show."""
        temp = self.cfg.sampling.temperature
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        logprobs, seen = _observed(logits, batch, torch.arange(len(batch.rewards), device=logits.device), temp)
        return logprobs * batch.loss_mask, seen

    def publish(self) -> dict[str, float]:
        wc = self.cfg.weights
        pub = publish(self.model, self.tokenizer, wc.dir, self.version, wc.keep)
        self.transport.announce_weights(pub.announcement)
        self.metrics.publish_seconds.observe(pub.seconds)
        self.metrics.publish_bytes.set(pub.nbytes)
        return {"time/publish_s": pub.seconds}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out problems (never used as RL prompts), graded like the actors grade."""
        problems = self.task.eval
        prompts = [list(self.tokenizer(p.prompt).input_ids) for p in problems]
        samples = generate(
            self.model,
            prompts,
            n=1,
            max_new_tokens=self.cfg.sampling.max_new_tokens,
            stop_ids=self.stop_ids,
            pad_id=self.pad_id,
            temperature=None,
        )
        result = self.grader.grade_samples(
            self.tokenizer,
            [g[0] for g in samples],
            [p.reference for p in problems],
            require_stop=self.cfg.task.require_stop,
        )
        accuracy = sum(result.scores) / len(result.scores)
        self.metrics.eval_accuracy.set(accuracy)
        return {"eval/accuracy": accuracy}

    def describe(self, stats: dict[str, float]) -> dict[str, Any]:
        """The metrics.jsonl row of a step (DESIGN §4 keys first)."""
        elapsed = time.perf_counter() - self._started
        row: dict[str, Any] = {
            "step": self.step,
            "policy_version": self.version,
            **{k: stats[k] for k in ("reward", "reward_std", "frac_reward_zero_std", "reward/trained")},
            **{k: stats.get(k, 0.0) for k in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")},
            "entropy": stats["entropy"],
            "completions/mean_length": stats["completions/mean_length"],
            "staleness/mean": stats["staleness/mean"],
            "staleness/max": stats["staleness/max"],
            "loss": stats["loss"],
            "lr": self.optimizer.param_groups[0]["lr"],
            "groups_consumed": self.groups_consumed,
            "groups_dropped": sum(self.dropped.values()),
            "groups_dead": self.dead,
            "time/step_s": stats["time/step_s"],
            "time/elapsed_s": elapsed,
            "groups_per_s": self.groups_consumed / elapsed,
            "tokens_per_s": stats["tokens"] / max(stats["time/train_s"], 1e-9),
        }
        row |= {k: v for k, v in stats.items() if k not in row and k != "tokens"}
        return row

    def record(self, row: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        m = self.metrics
        m.step.set(self.step)
        m.policy_version.set(self.version)
        if "reward" not in row:
            return
        m.reward.set(row["reward"])
        m.reward_trained.set(row["reward/trained"])
        m.frac_zero_std.set(row["frac_reward_zero_std"])
        for region in ("low", "high", "region"):
            m.clip_ratio.labels(region).set(row[f"clip_ratio/{region}_mean"])
        m.entropy.set(row["entropy"])
        m.staleness.labels("mean").set(row["staleness/mean"])
        m.staleness.labels("max").set(row["staleness/max"])
        m.loss.set(row["loss"])
        if "kl" in row:
            m.kl.set(row["kl"])
        m.lr.set(row["lr"])
        m.tokens_per_s.set(row["tokens_per_s"])
        m.step_seconds.observe(row["time/step_s"])


def disable_dropout(model: torch.nn.Module) -> None:
    """RL on a model with dropout would score the same tokens differently in each forward pass: the ratio would not
    start at 1 and the importance weights would be noise. As TRL does, dropout is switched off."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def _observed(
    logits: torch.Tensor, batch: Batch, rows: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token log-probs of ``rows`` (as common.grpo.token_logprobs), and over their completion tokens the policy's
    mean entropy and the mean |learner − engine| log-prob, all from one log-softmax."""
    mask = batch.loss_mask[rows]
    n = mask.sum().clamp(min=1)
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logprobs = logp_all.gather(-1, batch.input_ids[rows, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    mismatch = (logprobs - batch.behaviour_logprobs[rows]).abs() * mask
    return logprobs, {
        "entropy": float((entropy * mask).sum() / n),
        "mismatch/logprob_abs_mean": float(mismatch.sum() / n),
    }


# -- the process ------------------------------------------------------------------------------------------------


def run_learner(cfg: Config) -> int:
    torch.set_num_threads(cfg.learner.torch_threads)
    torch.manual_seed(cfg.run.seed)
    check_model_path(cfg.model.path)
    registry = CollectorRegistry()
    metrics = LearnerMetrics(registry)
    transport = Transport(cfg.redis, cfg.run.name, on_error=metrics.errors.inc, on_reconnect=metrics.reconnects.inc)
    transport.ping()
    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    write_resolved(cfg, Path(cfg.run.dir) / "config.json")
    lc = cfg.learner
    log.info(
        "loss %s, eps %.2f/%.2f, lr %g, %d groups x %d per step; %s",
        lc.loss_type,
        lc.epsilon_low,
        lc.epsilon_high,
        lc.lr,
        lc.batch_groups,
        cfg.actor.group_size,
        f"KL penalty beta={lc.beta}" if lc.beta > 0 else "KL penalty off (beta = 0): no reference model is loaded",
    )

    learner: Learner | None = None

    def health() -> tuple[bool, dict]:
        return True, {"role": "learner", "step": learner.step if learner else 0}

    grader = open_grader(cfg.grader)
    server = MetricsServer(registry, cfg.metrics.host, cfg.metrics.port, health)
    register_endpoint(cfg.run.dir, "learner", "learner", server.url)
    try:
        tokenizer, model = load_pretrained(cfg.model.path, cfg.model.dtype, cfg.model.device)
        disable_dropout(model)
        reference = None
        if lc.beta > 0:
            reference = load_pretrained(cfg.model.path, cfg.model.dtype, cfg.model.device)[1].requires_grad_(False)
        learner = Learner(cfg, transport, model, tokenizer, grader, metrics, reference)
        stop = learner.stop
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        log.info("learner: %d steps, metrics %s, run dir %s", cfg.run.steps, server.url, cfg.run.dir)
        return learner.run()
    finally:
        grader.close()
        server.close()
        transport.close()
