"""The learner's intake: ``read → decode → refuse or align → count``, until a batch of ``learner.batch_groups`` groups.

Rank 0 reads from Redis; under torchrun it sends each batch to the other ranks as the groups' wire bytes. A message
that fails to decode, or does not fit the model, is dead-lettered; a valid group that cannot be trained on now is
dropped with its reason (``DropReason``); both are counted in Redis with their reason, and never stop the learner.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import redis

from common.config import Config
from common.metrics import LearnerMetrics
from common.model.limits import message_byte_limit
from common.schemas import (
    Completions,
    DropReason,
    FilteredStats,
    GroupMessage,
    SchemaError,
    decode_group,
    encode_group,
)
from common.transport import Delivery, LearnerTransport, ReadLimits, StreamEntry
from learner.distributed import Ranks
from learner.identity import RunClaim
from learner.progress import Progress

log = logging.getLogger("learner")


@dataclass
class Collected:
    ids: list[str] = field(default_factory=list)
    groups: list[GroupMessage] = field(default_factory=list)
    wait_s: float = 0.0
    filtered: FilteredStats = field(default_factory=FilteredStats)  # what actors filtered out since the last batch


class Intake:
    def __init__(
        self,
        cfg: Config,
        transport: LearnerTransport,
        model: Any,
        metrics: LearnerMetrics,
        identity: RunClaim,
        ranks: Ranks | None,
        stop: threading.Event,
        waiting: Callable[[], object] = lambda: None,
    ):
        self.cfg = cfg
        self.transport = transport
        self.model = model
        self.metrics = metrics
        self.identity = identity
        self.ranks = ranks
        self.stop = stop
        self.waiting = waiting  # called at each read while a batch fills: the learner's liveness beat
        self.consumer = f"learner-{socket.gethostname()}-{os.getpid()}"
        self._filtered_before: FilteredStats | None = None  # the filtered hash's totals at the previous batch

    def collect(self, p: Progress) -> Collected | None:
        """The next batch for a learner at ``p`` (whose drop and dead-letter counts it moves): read from Redis by
        rank 0 and sent to the other ranks as the groups' wire bytes (None: asked to stop, every rank)."""
        if self.ranks is None:
            return self._collect(p)
        if self.ranks.is_rank0:
            batch = self._collect(p)
            sent = None if batch is None else {"ids": batch.ids, "wait_s": batch.wait_s,
                                                "filtered": batch.filtered.fields(),
                                                "groups": [to_ranks(g) for g in batch.groups]}  # fmt: skip
            self.ranks.broadcast(sent)
            return batch
        got = self.ranks.broadcast()
        if got is None:
            return None
        groups = [from_rank0(g) for g in got["groups"]]
        return Collected(got["ids"], groups, got["wait_s"], FilteredStats.from_fields(got["filtered"]))

    def _collect(self, p: Progress) -> Collected | None:
        """Read until ``batch_groups`` usable groups (None: asked to stop)."""
        want = self.cfg.learner.batch_groups
        batch = Collected()
        t0 = time.perf_counter()
        next_notice = t0 + 30
        backlog = self._backlog(p)
        held = set(p.window_groups)  # group ids trained since the last checkpoint, and taken for this batch
        while len(batch.groups) < want:
            if self.stop.is_set():
                return None
            self.waiting()
            got = self._read(backlog, want - len(batch.groups), p)
            if got is not None:
                self._take(got, batch, held, p)
            if time.perf_counter() > next_notice:
                next_notice += 30
                log.info("waiting for groups: %d of %d after %.0fs", len(batch.groups), want, time.perf_counter() - t0)
        return Collected(batch.ids, batch.groups, time.perf_counter() - t0, self._filtered_since(p.step))

    def _backlog(self, p: Progress) -> list[str]:
        """Between steps, what is pending for this consumer is the groups trained since the last checkpoint (the
        window) plus anything stranded: taken over at start, or read by a command whose reply was lost. Those come
        first, then new entries."""
        self.identity.check(self.transport.identity_id(), p)  # one HGET a step: did Redis lose the run?
        try:
            return self.transport.stranded(self.consumer, set(p.window_ids))  # fetched a page at a time
        except redis.ResponseError as e:
            if not self.identity.stream_gone(e, p):
                raise
            return []

    def _read(self, backlog: list[str], asked: int, p: Progress) -> Delivery | None:
        """Up to ``asked`` entries: the backlog's first (it shrinks by those dealt with), then new ones (None: the
        stream was gone and is back, nothing read)."""
        if backlog:
            got = self.transport.fetch(self.consumer, backlog, asked, self.read_limits)
            del backlog[: got.taken]
            return got
        try:
            return self.transport.read(self.consumer, asked, self.cfg.learner.read_block_ms, self.read_limits)
        except redis.ResponseError as e:
            if not self.identity.stream_gone(e, p):
                raise
            return None

    def _take(self, got: Delivery, batch: Collected, held: set[str], p: Progress) -> None:
        """Add the usable groups of one read to ``batch``; dead-letter or drop the others, counted by reason."""
        self._dead_on_arrival(got.dead, p)
        drops: dict[DropReason, list[str]] = {}
        decoded = [(entry, msg) for entry in list(got) if (msg := self.decode(entry, p)) is not None]
        trained = self.transport.trained_before([msg.group_id for _, msg in decoded])
        for (entry, msg), was_trained in zip(decoded, trained, strict=True):
            # The same group twice (an actor's write retried after a lost reply): it is trained once.
            reason = "duplicate" if was_trained or msg.group_id in held else self.drop_reason(msg, p)
            if reason:
                drops.setdefault(reason, []).append(entry.id)
            else:
                batch.ids.append(entry.id)
                batch.groups.append(self.aligned(msg, p))
                held.add(msg.group_id)
        for reason, dropped in drops.items():
            self.transport.drop(dropped, reason)
            p.count_dropped(reason, len(dropped), self.metrics)

    def _filtered_since(self, step: int) -> FilteredStats:
        """What actors filtered out since the previous batch: counted in Redis as each round was written (so no
        dropped group takes it along), read here once a batch, for the step's reward figures. A fresh run counts
        from its start, a resumed learner from its first batch."""
        totals = self.transport.filtered_totals()
        before = self._filtered_before
        if before is None:
            before = FilteredStats() if step == 0 else totals
        self._filtered_before = totals
        return totals.since(before)

    @functools.cached_property
    def read_limits(self) -> ReadLimits:
        """Bytes a read may load: entries over ``redis.max_message_bytes`` (derived from the model's limits) are
        dead-lettered inside Redis, and a read stops at 8 times that (at least 8 MiB)."""
        most = message_byte_limit(self.cfg)
        return ReadLimits(most, max(8 * most, 8 * 2**20), self.cfg.learner.dead_letter_keep)

    def _dead_on_arrival(self, dead: list[tuple[str, str]], p: Progress) -> None:
        """Count the oversized entries a read dead-lettered (in Redis already)."""
        for entry_id, reason in dead:
            log.warning("dead-lettered %s: %s", entry_id, reason)
        p.count_dead(len(dead), self.metrics)

    def decode(self, entry: StreamEntry, p: Progress) -> GroupMessage | None:
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
            p.count_dead(1, self.metrics)
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

    def drop_reason(self, msg: GroupMessage, p: Progress) -> DropReason | None:
        """Why a valid group cannot be trained on now, or None."""
        if len(msg.completions) != self.cfg.sampling.group_size:
            return "group_size"
        # In learner steps along this policy's lineage: "lineage" for weights of a dead branch (published by a
        # learner that crashed after its checkpoint), "future" for weights this learner has not reached.
        reason, staleness = p.lineage.age(msg.policy_version, msg.epoch, p.step)
        if reason:
            return reason
        # Too old: the importance ratio against a policy this far behind is no longer a small correction.
        if staleness > self.cfg.learner.max_staleness:
            return "stale"
        return None

    def aligned(self, msg: GroupMessage, p: Progress) -> GroupMessage:
        """The batch measures staleness as version − policy_version: a group of an earlier epoch is given the
        version its weights have in this epoch's numbering, so that it counts learner steps."""
        version = p.version - p.lineage.age(msg.policy_version, msg.epoch, p.step)[1]
        return msg if version == msg.policy_version else replace(msg, policy_version=version)


def to_ranks(msg: GroupMessage) -> tuple[bytes, int]:
    """A batch's group as rank 0 sends it to the other ranks: its wire bytes as the actor numbered it and the
    version :meth:`Intake.aligned` gave it. A group of an earlier epoch is renumbered, but its version runs stay in
    the actor's numbering (the learner ages its tokens relative to the newest run), and the wire holds the newest
    run to the group's version: sent renumbered, every other rank would refuse it."""
    runs = Completions.of(msg.completions).runs
    sent = msg if runs is None or runs.newest() == msg.policy_version else replace(msg, policy_version=runs.newest())
    return encode_group(sent), msg.policy_version


def from_rank0(got: Any) -> GroupMessage:
    """What :func:`to_ranks` sent, the group as rank 0 trains on it."""
    body, version = got
    msg = decode_group(body)
    return msg if msg.policy_version == version else replace(msg, policy_version=int(version))
