"""The learner: ``collect a batch → train → acknowledge → publish → evaluate → record``, until ``run.steps``.

Policy versions: version v is the policy after v learner steps; version 0 is ``model.path``. Actors stamp each group
with the version they sampled it with, and a group is trained at most ``max_staleness`` versions later. The
optimisation itself (advantages, off-policy correction, updates) is learner.trainer, which does no I/O.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import secrets
import signal
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import redis
import torch
from prometheus_client import CollectorRegistry

from common.config import Config, ConfigError, write_resolved
from common.evaluation import correctness, score_problems, summarise
from common.generation import generate, pad_token_id, stop_token_ids
from common.metrics import DropReason, LearnerMetrics, MetricsServer, process_registry, register_endpoint
from common.model_import import prepare_model_path
from common.models import load_pretrained
from common.schemas import FilteredStats, GroupMessage, SchemaError, WeightsAnnouncement, decode_group, encode_group
from common.storage import StorageError, fsync_dir, fsync_file, writing
from common.tasks import PromptEncoder, eval_problems
from common.transport import ReadLimits, StreamEntry, Transport, message_byte_limit, read_balance
from common.weights import newest_on_disk, publish, tensors_digest
from grader.pool import GraderPool, open_grader
from learner import checkpoint
from learner.alarms import Alarms
from learner.broadcast import Broadcaster, Snapshot, snapshot
from learner.checkpoint import Resumable
from learner.distributed import Ranks
from learner.lineage import Lineage
from learner.trackers import Trackers, check_trackers, open_trackers
from learner.trainer import Trainer, disable_dropout

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
        transport: Transport | None,
        model: Any,
        tokenizer: Any,
        grader: GraderPool,
        metrics: LearnerMetrics,
        reference: Any = None,
        ranks: Ranks | None = None,
    ):
        self.cfg = cfg
        # Under torchrun every rank runs this loop; rank 0 (main) alone uses Redis and writes files, the others
        # follow it through broadcasts (learner.distributed) and have no transport.
        self.ranks = ranks
        self.main = ranks is None or ranks.main
        self.transport = cast(Transport, transport)
        self.model = model
        self.tokenizer = tokenizer
        self.grader = grader
        self.metrics = metrics
        # Only the held-out problems: the learner never needs the training prompts.
        self.eval_problems = eval_problems(cfg.task, cfg.run.seed)
        self.encode = PromptEncoder(tokenizer, cfg.task)
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.pad_id = pad_token_id(tokenizer, self.stop_ids)
        self.trainer = Trainer(cfg, model, self.pad_id, reference, ranks)
        lc = cfg.learner
        self.alarms = Alarms(lc.alarm_window, lc.alarm_clip_ratio, lc.alarm_zero_std)
        self.consumer = f"learner-{socket.gethostname()}-{os.getpid()}"
        self.version = 0
        self.step = 0
        self.groups_consumed = 0
        self.dropped: Counter[str] = Counter()
        self.dead = 0
        self._filtered_seen: FilteredStats | None = None  # the filtered hash's totals at the previous batch
        self.stop = threading.Event()
        self.metrics_path = Path(cfg.run.dir) / "metrics.jsonl"
        # Trained since the last checkpoint, not yet acknowledged: the checkpoint that covers them acks them.
        self.window_ids: list[str] = []
        self.window_groups: list[str] = []
        self.checkpointed_step = -1
        self._started = time.perf_counter()
        self.broadcaster: Broadcaster | None = None  # weights.transport nccl, rank 0
        self._publish_lock = threading.Lock()  # one writer: the broadcast thread may write a version to disk too
        self._announced = -1  # the newest version this learner announced
        self._last_announcement: WeightsAnnouncement | None = None  # announced again if Redis loses it
        self.run_id = ""  # the run's identity in Redis (see check_identity)
        self.lineage = Lineage()  # the epochs of this policy's lineage: staleness is measured along it
        self.trackers = Trackers()  # run.trackers, opened by run() on rank 0 once the run's identity is known

    # -- the loop -----------------------------------------------------------------------------------------------

    def run(self) -> int:
        if self.main:
            self.transport.ensure_consumer_group()
        # The run's identity is checked before anything in Redis is touched (resume acknowledges what its checkpoint
        # covers): a learner pointed at another run's Redis must change nothing there.
        resumed = self.resume()
        if self.main:
            if not resumed:
                self.claim_identity()
            taken = self.transport.claim_pending(self.consumer)  # read by an earlier learner, never settled
            if taken:
                log.info("took over %d groups an earlier learner had read and not settled", len(taken))
            # After the identity: it names the W&B run. The next row is step 0, or the one after the checkpoint.
            self.trackers = open_trackers(self.cfg, self.run_id, self.step + 1 if resumed else 0)
        self.continue_versions()
        if self.main:
            self.transport.clear_done()  # (re)started to train: actors must not stop
        self.publish()  # actors align with the version the learner starts (or resumes) from
        if not resumed:
            if self.main:
                self._truncate_metrics(-1)  # rows of an earlier attempt that never checkpointed: trained again
            self.record({"step": 0, "policy_version": self.version, **self.evaluate()})
        steps = self.cfg.run.steps
        last = time.perf_counter()
        while self.step < steps:
            batch = self.collect()
            if batch is None:
                self.checkpoint()
                log.info("stopped at step %d of %d (asked to stop); checkpoint written", self.step, steps)
                return 0
            t_train = time.perf_counter()
            stats = self.trainer.step(batch.groups, self.version)
            pad = self.cfg.learner.min_step_s - (time.perf_counter() - t_train)
            if pad > 0:  # benchmarks: a step of controlled time (learner.min_step_s)
                self.stop.wait(pad)
            self.settle(batch, stats)
            self.step += 1
            self.version += 1  # equal to the step, unless a resume skipped versions (see continue_versions)
            stats["time/train_s"] = time.perf_counter() - t_train
            if self.step % self.cfg.learner.publish_every == 0 or self.step == steps:
                stats |= self.publish()
            if self.step % self.cfg.learner.eval_every == 0 or self.step == steps:
                stats |= self.evaluate()
            if self.main:
                stats |= self.stream_figures()
            now = time.perf_counter()
            stats |= {"time/step_s": now - last, "time/wait_s": batch.wait_s}
            last = now
            row = self.describe(stats)
            self.record(row)
            # After the row: a checkpoint must never cover a step whose row was not written (a learner killed in
            # between would resume past it and the row would be lost; killed before, it retrains the step).
            if self.step % self.cfg.checkpoint.every == 0 or self.step == steps:
                self.checkpoint()
            if self.main:
                self.raise_alarms(row)
        if not self.main:
            return 0
        self.transport.mark_done()
        log.info(
            "finished %d steps in %.1fs; %d groups trained",
            steps,
            time.perf_counter() - self._started,
            self.groups_consumed,
        )
        return 0

    def settle(self, batch: Collected, stats: dict[str, float]) -> None:
        """The step's groups are trained, and acknowledged by the checkpoint that covers the step, unless none of
        its updates could be applied (every gradient non-finite, see learner.trainer): the policy learnt nothing
        from them, so they are dropped now as ``nonfinite``, not counted as trained; the step still counts, and its
        row says ``updates_skipped_nonfinite`` and a null loss."""
        skipped = int(stats.get("updates_skipped_nonfinite", 0))
        self.metrics.updates_skipped.inc(skipped)
        if skipped < self.cfg.learner.updates_per_batch:
            self.window_ids += batch.ids
            self.window_groups += [g.group_id for g in batch.groups]
            self.groups_consumed += len(batch.ids)
            self.metrics.groups_consumed.inc(len(batch.ids))
            return
        log.warning("step %d: every update was non-finite and none was applied; its %d groups are dropped as "
                    "nonfinite", self.step + 1, len(batch.ids))  # fmt: skip
        if self.main:
            self.transport.drop(batch.ids, "nonfinite")
        self.dropped["nonfinite"] += len(batch.ids)
        self.metrics.groups_dropped.labels("nonfinite").inc(len(batch.ids))

    # -- checkpoints --------------------------------------------------------------------------------------------

    def checkpoint(self) -> dict[str, float]:
        """Write the learner's whole state, then acknowledge the groups it covers (see learner.checkpoint)."""
        if self.step == self.checkpointed_step and not self.window_ids:
            return {}
        if self.main:  # the rows of the steps it covers reach the disk before it does (see run)
            self._sync_metrics()
        t0 = time.perf_counter()
        cc = self.cfg.checkpoint
        state = Resumable(self.step, self.version, self.counters(), self.window_ids, self.window_groups,
                          self.run_id, self.lineage.to_json())  # fmt: skip
        t = self.trainer
        checkpoint.save(cc.dir, state, self.model, t.optimizer, t.scheduler, t.generator, cc.keep, self.ranks)
        if self.main:
            self.transport.ack_trained(self.window_ids, self.window_groups, self.step, cc.dedup_window)
        self.window_ids, self.window_groups = [], []
        self.checkpointed_step = self.step
        seconds = time.perf_counter() - t0
        self.metrics.checkpoint_seconds.observe(seconds)
        self.metrics.checkpoint_step.set(self.step)
        return {"time/checkpoint_s": seconds}

    def counters(self) -> dict[str, Any]:
        return {"groups_consumed": self.groups_consumed, "dropped": dict(self.dropped), "dead": self.dead}

    def resume(self) -> bool:
        """Continue from the newest checkpoint, if there is one: weights, optimizer, schedule, RNG, step and version
        (so published versions continue their sequence). Groups it covers are acknowledged first; groups trained
        after it were never acknowledged and are read again."""
        path = checkpoint.latest(self.cfg.checkpoint.dir) if self.main else None
        if self.ranks is not None:  # the one rank 0 found, whatever the others' view of the directory
            chosen = self.ranks.broadcast(None if path is None else str(path))
            path = None if chosen is None else Path(chosen)
        if path is None:
            return False
        t = self.trainer
        r = checkpoint.load(path, self.model, t.optimizer, t.scheduler, t.generator, self.ranks)
        self.step, self.version, self.checkpointed_step = r.step, r.version, r.step
        self.metrics.checkpoint_step.set(r.step)
        self.groups_consumed = r.counters.get("groups_consumed", 0)
        self.dropped = Counter(r.counters.get("dropped", {}))
        self.dead = r.counters.get("dead", 0)
        self.run_id = r.run_id
        # A checkpoint of an earlier build has no lineage: only its own step and version are known to match.
        self.lineage = Lineage.from_json(r.epochs or [[0, r.step, r.version]])
        if not self.main:
            return True
        self.claim_identity()
        self.transport.ack_trained(r.covers, r.covers_groups, r.step, self.cfg.checkpoint.dedup_window)
        self._truncate_metrics(r.step)
        log.info("resumed from %s: step %d, policy version %d", path, r.step, r.version)
        return True

    def continue_versions(self) -> None:
        """A learner that crashed may have published weights of steps that no checkpoint has (or before its first
        checkpoint). Versions must never go back or name two different weights (actors and staleness rely on
        both): the weights we start from become the next version after every one announced or still on disk (a
        Redis that lost its data no longer says), and a new epoch of the lineage begins there (learner.lineage)."""
        if self.main:
            try:
                announced = self.transport.latest_weights()
            except SchemaError as e:  # garbage in weights:latest: this learner's first announcement replaces it
                log.warning("ignoring weights:latest: %s", e)
                announced = None
            top = max(-1 if announced is None else announced.version, newest_on_disk(self.cfg.weights.dir))
            if top > self.version:
                epoch = max(self.lineage.current.epoch, 0 if announced is None else announced.epoch) + 1
                log.info("version %d was published by an earlier learner after the state we start from: continuing "
                         "at version %d (epoch %d, from step %d)", top, top + 1, epoch, self.step)  # fmt: skip
                self.version = top + 1
                self.lineage.begin(epoch, self.step, self.version)
        if self.ranks is not None:
            self.version = int(self.ranks.broadcast(self.version))

    # -- the run's identity in Redis --------------------------------------------------------------------------

    def claim_identity(self) -> None:
        """At start: the run id in Redis must be the checkpoint's. A fresh learner adopts the one in Redis (an
        earlier learner of this run died before its first checkpoint) or names the run; a checkpoint of an earlier
        build, which has none, names it too."""
        found = self.transport.identity_id()
        if not self.run_id:
            self.run_id = found or secrets.token_hex(8)
            self.transport.create_identity(self.run_id)
            return
        self.check_identity(found)

    def check_identity(self, found: str | None) -> None:
        """``found``: the run id Redis holds now. Another run's id is a configuration mistake (two runs under one
        ``run.name``); none at all means Redis lost this run's state, and the run goes on (see redis_lost)."""
        if found == self.run_id:
            return
        if found is not None:
            raise ConfigError(
                f"config error: Redis holds run {found} under run.name {self.cfg.run.name}, but this learner's "
                f"checkpoints ({self.cfg.checkpoint.dir}) are run {self.run_id}'s: give each run its own run.name"
            )
        self.redis_lost()

    def redis_lost(self) -> None:
        """Redis restarted without persistence, was flushed or failed over to an empty replica: the stream, the
        counters and the announcement are gone. Name the run again (recording what was lost), recreate the stream,
        announce the current version again, and train on."""
        log.warning("Redis lost this run's state (restarted without persistence, flushed, or an empty replica): "
                    "%d groups trained until step %d are no longer in its counters (recorded in %s); the groups in "
                    "its stream are gone; training goes on", self.groups_consumed, self.step,
                    self.transport.keys.identity)  # fmt: skip
        self.transport.record_reset(self.run_id, self.step, self.groups_consumed)
        self.transport.ensure_consumer_group()
        self.window_ids, self.window_groups = [], []  # their entries are gone: nothing is left to acknowledge
        with self._publish_lock:  # the broadcast thread may be announcing a newer one: never announce over it
            if self._last_announcement is not None:  # actors holding it see a version that did not go back
                self.transport.announce_weights(self._last_announcement)

    def _stream_gone(self, e: redis.ResponseError) -> bool:
        """Whether a reply says the stream or its consumer group no longer exists (then: what happened to Redis?)."""
        text = str(e)
        if "NOGROUP" not in text and "no longer exists" not in text:
            return False
        self.check_identity(self.transport.identity_id())
        self.transport.ensure_consumer_group()  # the identity survived (the stream alone was deleted): recreate it
        return True

    def _truncate_metrics(self, step: int) -> None:
        """Rows of steps after the checkpoint are about to be trained again: drop them rather than repeat them. A
        last row cut short (the disk filled up, or the learner died, while it was written) is dropped with a
        warning: its step is trained again like the others past the checkpoint."""
        if not self.metrics_path.exists():
            return
        with writing(self.metrics_path):
            text = self.metrics_path.read_text()
            rows = [json.loads(line) for line in metrics_rows(text, self.metrics_path)]
            kept = [row for row in rows if row.get("step", 0) <= step]
            lines = sum(1 for line in text.splitlines() if line.strip())
            if len(kept) < lines or (text and not text.endswith("\n")):  # rows past the checkpoint, or a torn one
                tmp = self.metrics_path.with_name(".metrics.jsonl.tmp")
                with tmp.open("w") as f:
                    f.write("".join(_json_row(row) + "\n" for row in kept))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.metrics_path)
                fsync_dir(self.metrics_path.parent)

    def _sync_metrics(self) -> None:
        if self.metrics_path.exists():
            with writing(self.metrics_path):
                fsync_file(self.metrics_path)

    # -- steps --------------------------------------------------------------------------------------------------

    def collect(self) -> Collected | None:
        """The next batch: read from Redis by rank 0 and sent to the other ranks as the groups' wire bytes (None:
        asked to stop, every rank)."""
        if self.ranks is None:
            return self._collect()
        if self.main:
            batch = self._collect()
            sent = None if batch is None else {"ids": batch.ids, "wait_s": batch.wait_s,
                                                "groups": [encode_group(g) for g in batch.groups]}  # fmt: skip
            self.ranks.broadcast(sent)
            return batch
        got = self.ranks.broadcast()
        return None if got is None else Collected(got["ids"], [decode_group(g) for g in got["groups"]], got["wait_s"])

    def _collect(self) -> Collected | None:
        """Read until ``batch_groups`` usable groups: a message that fails to decode is dead-lettered, a group too
        far behind (or ahead of) the learner's version is dropped, both counted in Redis with their reason."""
        want = self.cfg.learner.batch_groups
        ids: list[str] = []
        groups: list[GroupMessage] = []
        t0 = time.perf_counter()
        next_notice = t0 + 30
        # Between steps, what is pending for this consumer is the groups trained since the last checkpoint (the
        # window) plus anything stranded: taken over at start, or read by a command whose reply was lost. Those
        # come first, then new entries.
        self.check_identity(self.transport.identity_id())  # one HGET a step: did Redis lose the run?
        try:
            backlog = self.transport.stranded(self.consumer, set(self.window_ids))  # ids: fetched a page at a time
        except redis.ResponseError as e:
            if not self._stream_gone(e):
                raise
            backlog = []
        held = set(self.window_groups)  # group ids trained since the last checkpoint, and taken for this batch
        while len(groups) < want:
            if self.stop.is_set():
                return None
            asked = want - len(groups)
            if backlog:
                got = self.transport.fetch(self.consumer, backlog, asked, self.read_limits)
                backlog = backlog[got.taken :]
            else:
                try:
                    got = self.transport.read(self.consumer, asked, self.cfg.learner.read_block_ms, self.read_limits)
                except redis.ResponseError as e:
                    if not self._stream_gone(e):
                        raise
                    continue
            self._dead_on_arrival(got.dead)
            entries = list(got)
            drops: dict[DropReason, list[str]] = {}
            decoded = [(entry, msg) for entry in entries if (msg := self.decode(entry)) is not None]
            trained = self.transport.trained_before([msg.group_id for _, msg in decoded])
            for (entry, msg), seen in zip(decoded, trained, strict=True):
                # The same group twice (an actor's write retried after a lost reply): it is trained once.
                reason = "duplicate" if seen or msg.group_id in held else self.refusal(msg)
                if reason:
                    drops.setdefault(reason, []).append(entry.id)
                else:
                    ids.append(entry.id)
                    groups.append(self.aligned(msg))
                    held.add(msg.group_id)
            for reason, dropped in drops.items():
                self.transport.drop(dropped, reason)
                self.dropped[reason] += len(dropped)
                self.metrics.groups_dropped.labels(reason).inc(len(dropped))
            if time.perf_counter() > next_notice:
                next_notice += 30
                log.info("waiting for groups: %d of %d after %.0fs", len(groups), want, time.perf_counter() - t0)
        return Collected(ids, self._with_filtered(groups), time.perf_counter() - t0)

    def _with_filtered(self, groups: list[GroupMessage]) -> list[GroupMessage]:
        """What actors filtered out since the previous batch (counted in Redis as each round was written, so no
        dropped group takes it along) joins the batch's first group, where the reward figures read it (and where it
        travels to the other ranks). A fresh run counts from its start, a resumed learner from its first batch."""
        totals = self.transport.filtered_totals()
        seen = self._filtered_seen
        if seen is None:
            seen = FilteredStats() if self.step == 0 else totals
        self._filtered_seen = totals
        new = totals.since(seen)
        if not new.groups:
            return groups
        return [replace(groups[0], filtered=groups[0].filtered + new), *groups[1:]]

    @functools.cached_property
    def read_limits(self) -> ReadLimits:
        """Bytes a read may load: entries over ``redis.max_message_bytes`` (derived from the model's limits) are
        dead-lettered inside Redis, and a read stops at 8 times that (at least 8 MiB)."""
        most = message_byte_limit(self.cfg)
        return ReadLimits(most, max(8 * most, 8 * 2**20), self.cfg.learner.dead_letter_keep)

    def _dead_on_arrival(self, dead: list[tuple[str, str]]) -> None:
        """Count the oversized entries a read dead-lettered (in Redis already)."""
        for entry_id, reason in dead:
            log.warning("dead-lettered %s: %s", entry_id, reason)
        self.dead += len(dead)
        self.metrics.groups_dead.inc(len(dead))

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
            self.transport.dead_letter(entry, str(e), self.cfg.learner.dead_letter_keep)
            self.dead += 1
            self.metrics.groups_dead.inc()
            return None

    def check_fits(self, msg: GroupMessage) -> None:
        """Token ids the embedding does not have, or sequences longer than the model's positions, would crash a
        forward pass: such a message is as malformed as bad msgpack."""
        vocab = self.model.get_input_embeddings().num_embeddings
        longest = getattr(self.model.config, "max_position_embeddings", None)
        c = msg.columns
        top = max(int(msg.prompt_ids.max()), int(c.token_ids.max()))
        if top >= vocab:
            raise SchemaError(f"token id {top} outside the model's vocabulary of {vocab}")
        if longest is not None and len(msg.prompt_ids) + int(c.lengths.max()) > longest:
            raise SchemaError(f"{len(msg.prompt_ids) + int(c.lengths.max())} tokens exceed the model's {longest}")

    def refusal(self, msg: GroupMessage) -> DropReason | None:
        """Why a valid group cannot be trained on now, or None."""
        if len(msg.completions) != self.cfg.sampling.group_size:
            return "group_size"
        # In learner steps along this policy's lineage: "lineage" for weights of a dead branch (published by a
        # learner that crashed after its checkpoint), "future" for weights this learner has not reached.
        reason, staleness = self.lineage.age(msg.policy_version, msg.epoch, self.step)
        if reason:
            return reason
        # Too old: the importance ratio against a policy this far behind is no longer a small correction.
        if staleness > self.cfg.learner.max_staleness:
            return "stale"
        return None

    def aligned(self, msg: GroupMessage) -> GroupMessage:
        """The batch measures staleness as version − policy_version: a group of an earlier epoch is given the
        version its weights have in this epoch's numbering, so that it counts learner steps."""
        version = self.version - self.lineage.age(msg.policy_version, msg.epoch, self.step)[1]
        return msg if version == msg.policy_version else replace(msg, policy_version=version)

    def publish(self) -> dict[str, float]:
        """Rank 0 hands the version on and announces it; under torchrun every rank first helps gather it whole.
        ``weights.transport`` disk: written to ``weights.dir``. nccl: a CPU snapshot goes to the broadcast thread
        (learner.broadcast), which announces it once its actors have it, or writes it to disk when they could not
        take it; the first and last versions, every ``weights.disk_every``-th, and any version some live actor
        cannot take over NCCL are written to disk here."""
        whole = self.ranks.full_model_state(self.model) if self.ranks is not None else None
        if not self.main:
            return {}
        wc = self.cfg.weights
        t0 = time.perf_counter()
        if wc.transport == "nccl":
            if self.broadcaster is None:
                device = str(self.ranks.device) if self.ranks is not None else self.cfg.model.device
                self.broadcaster = Broadcaster(
                    self.cfg, self.transport, self.metrics, to_disk=self._fall_back,
                    announce_nccl=self._announce_nccl, announced=lambda: self._announced, device=device,
                )  # fmt: skip
            first, last = self._announced < 0, self.step == self.cfg.run.steps
            periodic = wc.disk_every > 0 and self.version % wc.disk_every == 0
            b = self.broadcaster
            counts = {"weights/nccl_rounds": float(b.rounds_ok), "weights/nccl_fallbacks": float(b.fallbacks)}
            if not (first or last or periodic or self._actors_without_nccl()):
                b.submit(self.version, snapshot(self.model, whole, wc.dtype, int(wc.nccl_bucket_mb * 2**20)))
                return {"time/publish_s": time.perf_counter() - t0, **counts}
        else:
            counts = {}
        self._write(self.version, whole)
        return {"time/publish_s": time.perf_counter() - t0, **counts}

    def _write(self, version: int, state: dict[str, torch.Tensor] | None) -> None:
        """Write ``version`` to ``weights.dir`` and announce it, unless a newer one was announced meanwhile (the
        broadcast thread falls back late). One writer: the training loop and the broadcast thread both come here,
        and the lock covers the check, the write and the announcement, so their writes never overlap and the prune
        keeps the version announced until the next one is (the training loop may wait for a fall-back's write)."""
        wc = self.cfg.weights
        with self._publish_lock:
            if version < self._announced:
                return
            with writing(wc.dir):
                pub = publish(
                    self.model,
                    self.tokenizer,
                    wc.dir,
                    version,
                    wc.keep,
                    wc.dtype,
                    wc.digest,
                    prune_in_background=True,
                    state_dict=state,
                    protect=[self._announced],
                )
            self._announce(pub.announcement)
            self._announced = version
        self.metrics.publish_seconds.observe(pub.seconds)
        self.metrics.publish_bytes.set(pub.nbytes)

    def _fall_back(self, version: int, snap: Snapshot) -> None:
        self._write(version, snap.tensors())

    def _announce_nccl(self, version: int, snap: Snapshot) -> None:
        """Announce a version its members received over NCCL (``format: nccl``): actors that hold it skip it; the
        digest (of the bytes sent) names its contents."""
        checked, nbytes = tensors_digest(snap.flats, self.cfg.weights.digest)
        b = self.broadcaster
        group = b.group.name if b is not None and b.group is not None else ""
        uri = f"nccl://{b.address if b is not None else ''}/{group}"
        with self._publish_lock:
            if version <= self._announced:
                return
            self._announce(WeightsAnnouncement(version, uri, checked, format="nccl"))
            self._announced = version
        self.metrics.publish_bytes.set(nbytes)

    def _announce(self, ann: WeightsAnnouncement) -> None:
        """Announce with this lineage's epoch (actors stamp it on their groups), and keep it to announce again."""
        ann = replace(ann, epoch=self.lineage.current.epoch)
        self.transport.announce_weights(ann)
        self._last_announcement = ann

    def _actors_without_nccl(self) -> bool:
        """Whether a live actor is not a member of the update group (its engine loads from disk only)."""
        assert self.broadcaster is not None
        return bool(set(self.transport.live_actors()) - set(self.broadcaster.members()))

    def close(self) -> None:
        self.trackers.close()
        if self.broadcaster is not None:
            self.broadcaster.close()
            self.broadcaster = None

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy pass@1 on the held-out problems (never used as RL prompts), graded like the actors grade: the
        evaluation of ``grpo eval`` (common/evaluation.py), with the learner's own model."""

        def greedy(prompts: Any, n: int, _greedy: bool) -> Any:
            return generate(self.model, prompts, n=n, max_new_tokens=self.cfg.sampling.max_new_tokens,
                            stop_ids=self.stop_ids, pad_id=self.pad_id, temperature=None)  # fmt: skip

        t0 = time.perf_counter()
        with self.trainer.autocast():
            scores = score_problems(
                self.eval_problems,
                self.encode,
                greedy,
                self.grader,
                self.tokenizer,
                n=0,
                batch=self.cfg.task.eval_batch,
                require_stop=self.cfg.task.require_stop,
            )
        accuracy = summarise(scores.greedy, scores.sampled)["pass_at_1"]
        self.metrics.eval_accuracy.set(accuracy)
        return {"eval/accuracy": accuracy, "time/eval_s": time.perf_counter() - t0}

    def stream_figures(self) -> dict[str, float]:
        """Groups waiting in the stream, for dashboards (one transaction, as the accounting equation reads them)."""
        b = read_balance(self.transport)
        self.metrics.stream_groups.labels("unread").set(b.unread)
        self.metrics.stream_groups.labels("pending").set(b.pending)
        self.metrics.unexplained.set(b.unexplained)
        return {"stream/unread": b.unread, "stream/pending": b.pending}

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
            "lr": stats["lr"],
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

    def raise_alarms(self, row: dict[str, Any]) -> None:
        for message in self.alarms.update(row):
            log.warning("alarm: %s", message)
        for kind, on in self.alarms.active.items():
            self.metrics.alarm.labels(kind).set(int(on))

    def record(self, row: dict[str, Any]) -> None:
        if not self.main:
            return
        with writing(self.metrics_path), self.metrics_path.open("a") as f:
            f.write(_json_row(row) + "\n")
        self.trackers.log(row)  # after metrics.jsonl, the record; a tracker's failure never reaches training
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


# -- the process ------------------------------------------------------------------------------------------------


def _json_row(row: dict[str, Any]) -> str:
    """Strict JSON (``Infinity`` and ``NaN`` are not JSON): a figure that is not a finite number, such as the loss
    of a step whose every update was skipped, is written as null."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
    return json.dumps(clean, allow_nan=False)


def metrics_rows(text: str, path: Path) -> list[str]:
    """The rows of metrics.jsonl. Only the last can be cut short (rows are appended, and the file is truncated to
    its complete rows before a learner appends again): it is left out with a warning. Any other line that is not
    JSON was damaged some other way: :class:`StorageError`, one line."""
    lines = text.splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except ValueError:
            if n == len(lines):
                log.warning("%s: the last row (line %d) was cut short, left out: its step is trained again", path, n)
                continue
            raise StorageError(path, f"line {n} is not JSON; fix or remove it") from None
        rows.append(line)
    return rows


def load_models(cfg: Config, device: str | None = None) -> tuple[Any, Any, Any]:
    """Tokenizer, policy, and the frozen reference policy — loaded only when beta > 0, else None."""
    device = device or cfg.model.device
    tokenizer, model = load_pretrained(cfg.model.path, cfg.model.dtype, device)
    disable_dropout(model)
    reference = None
    if cfg.learner.beta > 0:
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
            smallest = lc.batch_groups * cfg.sampling.group_size // (lc.updates_per_batch * lc.grad_accum)
            if smallest < ranks.world:  # every rank needs rows of every micro-batch (one forward each)
                raise ConfigError(
                    f"config error: learner.batch_groups: micro-batches of {smallest} completions cannot be split "
                    f"over {ranks.world} ranks; raise learner.batch_groups or lower updates_per_batch x grad_accum"
                )
        if ranks is not None and not ranks.main:
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
    transport = Transport(cfg.redis, cfg.run.name, on_error=metrics.errors.inc, on_reconnect=metrics.reconnects.inc)
    transport.ping()
    made = not Path(cfg.run.dir).exists()  # a start refused on the user's input removes the directory it made
    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    write_resolved(cfg, Path(cfg.run.dir) / "config.json")
    lc = cfg.learner
    log.info(
        "loss %s, eps %.2f/%.2f, lr %g, %d groups x %d per step; %s%s",
        lc.loss_type,
        lc.epsilon_low,
        lc.epsilon_high,
        lc.lr,
        lc.batch_groups,
        cfg.sampling.group_size,
        f"KL penalty beta={lc.beta}" if lc.beta > 0 else "KL penalty off (beta = 0): no reference model is loaded",
        f"; FSDP2 over {ranks.world} ranks" if ranks is not None else "",
    )

    learner: Learner | None = None

    def health() -> tuple[bool, dict]:
        return True, {"role": "learner", "step": learner.step if learner else 0}

    grader = open_grader(correctness(cfg.grader))  # the learner grades only its evaluation: right or wrong
    server = MetricsServer(registry, cfg.metrics.host, cfg.metrics.port, health)
    endpoint = register_endpoint(cfg.run.dir, "learner", "learner", server.url)
    try:
        tokenizer, model, reference = _models(cfg, ranks)
        metrics.reference_loaded.set(int(reference is not None))
        learner = Learner(cfg, transport, model, tokenizer, grader, metrics, reference, ranks)
        stop = learner.stop
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        log.info("learner: %d steps, metrics %s, run dir %s", cfg.run.steps, server.url, cfg.run.dir)
        return learner.run()
    except ConfigError:
        if made and learner is None:  # refused before training (the task, the chat template): nothing is left
            _unmake_run_dir(Path(cfg.run.dir), endpoint)
        raise
    finally:
        if learner is not None:
            learner.close()
        grader.close()
        server.close()
        transport.close()


def _unmake_run_dir(run_dir: Path, endpoint: Path) -> None:
    """Remove what a refused start wrote in the run directory it made (config.json, its endpoint), then the
    directory itself once empty: rmdir only, so anything another process wrote there stays."""
    for f in (run_dir / "config.json", endpoint):
        f.unlink(missing_ok=True)
    for d in (endpoint.parent, run_dir):
        with contextlib.suppress(OSError):
            d.rmdir()
