"""The run's state in Redis (part of common.transport): the weights announcement, the done mark, the run's
identity, the durable counters and the accounting equation read from them (:func:`read_balance`)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import redis

from common.schemas import (
    PRODUCED,
    DoneMark,
    FilteredStats,
    RunCounters,
    RunIdentity,
    WeightsAnnouncement,
    as_text,
    weights_wakeup,
)
from common.transport.admission import UNREAD
from common.transport.connection import CONSUMER_GROUP, Connection, Lua
from common.transport.lease import Leasing
from common.transport.refusals import refusal

log = logging.getLogger("common.transport")


@dataclass(frozen=True)
class Balance:
    """The accounting equation of DESIGN §4, read from Redis alone."""

    produced: int
    trained: int
    dropped: dict[str, int]
    dead: int
    in_stream: int  # unread + pending (acked entries are deleted)
    filtered: dict[str, int]
    unread: int = 0  # in the stream, not yet read by a learner
    # (the rest of in_stream is pending: read, and waiting for the checkpoint that covers its step)
    discarded: dict[str, int] = field(default_factory=dict)  # sampled by actors, never sent (outside the equation)

    @property
    def pending(self) -> int:
        return self.in_stream - self.unread

    @property
    def unexplained(self) -> int:
        return self.produced - self.trained - sum(self.dropped.values()) - self.dead - self.in_stream

    def equation(self) -> str:
        dropped = sum(self.dropped.values())
        ok = "balanced" if self.unexplained == 0 else f"UNEXPLAINED {self.unexplained}"
        return (
            f"produced {self.produced} = trained {self.trained} + dropped {dropped} + dead {self.dead}"
            f" + pending {self.pending} + unread {self.unread}  ({ok})"
        )


class WeightsChannel:
    """One subscriber's ``weights`` channel (:meth:`RunReading.subscribe_weights`): ``get_message`` returns a wake-up
    (redis-py's message dict) or None. A refusal that comes on its connection is no message: it is Redis's reply to
    the PING with which redis-py checks an idle connection (refused while Redis is busy with a script or cannot
    persist), and the subscription stands."""

    def __init__(self, pubsub: redis.client.PubSub):
        self._pubsub = pubsub

    def get_message(self, timeout: float = 0.0) -> dict[str, Any] | None:
        try:
            return self._pubsub.get_message(timeout=timeout)
        except redis.ResponseError as e:
            if refusal(e) is None:
                raise
            log.debug("the weights channel's health check was refused for now: %s", e)
            return None

    def close(self) -> None:
        self._pubsub.close()


class RunReading(Connection):
    """What every role reads of the run's state: the announced weights, the done mark, the identity, the counters and
    the accounting equation."""

    _unread_script = Lua(UNREAD)

    def latest_weights(self) -> WeightsAnnouncement | None:
        """The announced version; None when none is; SchemaError (one line) when the hash is malformed: every
        reader treats that as bad input, and the learner's next announcement replaces it."""
        h = self._do(lambda: self.client.hgetall(self.keys.weights_latest))
        return WeightsAnnouncement.from_hash(h) if h else None

    def subscribe_weights(self) -> WeightsChannel:
        """The ``weights`` channel, subscribed: the confirmation is read here, so that Redis refusing the SUBSCRIBE
        for now (busy with a script) is waited out as any call is (:meth:`_do`), not met by a later read."""

        def subscribe() -> WeightsChannel:
            ps = self.client.pubsub()
            try:
                ps.subscribe(self.keys.weights_channel)
                confirmed = ps.get_message(timeout=self._cfg.socket_timeout_s)
                if confirmed is None or confirmed["type"] != "subscribe":
                    raise redis.TimeoutError(f"SUBSCRIBE {self.keys.weights_channel}: no confirmation")
            except BaseException:
                ps.close()
                raise
            ps.ignore_subscribe_messages = True
            return WeightsChannel(ps)

        return self._do(subscribe)

    def is_done(self) -> bool:
        """Whether the learner marked the run finished. A run name is one run: an actor that starts (or restarts)
        after the mark exits at once, and a learner resuming a run clears the mark while it trains."""
        return bool(self._do(lambda: self.client.exists(self.keys.done)))

    def identity(self) -> RunIdentity | None:
        """The run's identity; None when Redis holds none (a new run, or a Redis that lost its data); SchemaError
        (one line) when the hash is malformed."""
        h = self._do(lambda: self.client.hgetall(self.keys.identity))
        return RunIdentity.from_hash(h) if h else None

    def identity_id(self) -> str | None:
        """The run id alone: one HGET, cheap enough for every learner step."""
        v = self._do(lambda: self.client.hget(self.keys.identity, "id"))
        return None if v is None else as_text(v)

    def counters(self) -> RunCounters:
        """The durable counters (hash ``stats``); SchemaError (one line) when the hash holds something else."""
        return RunCounters.from_hash(self._do(lambda: self.client.hgetall(self.keys.stats)))

    def stats(self) -> dict[str, int]:
        """The non-zero counters by field name, as integers (read through :class:`RunCounters`)."""
        return self.counters().to_hash()

    def filtered_totals(self) -> FilteredStats:
        """The running sums over every group actors filtered out (see :meth:`produce`)."""
        h = self._do(lambda: self.client.hgetall(self.keys.filtered))
        return FilteredStats.from_fields({as_text(k): float(v) for k, v in h.items()})

    def balance(self) -> Balance:
        """The accounting equation's terms (:class:`Balance`), read in one transaction, so that the counters and the
        stream's length are of the same instant."""

        def build(pipe: Any) -> None:
            pipe.hgetall(self.keys.stats)
            pipe.xlen(self.keys.groups)
            self._unread_script(keys=[self.keys.groups], args=[CONSUMER_GROUP], client=pipe)

        raw, xlen, unread = self._batch(build, transaction=True)
        c = RunCounters.from_hash(raw)
        return Balance(
            produced=c.produced,
            trained=c.trained,
            dropped=c.dropped,
            dead=c.dead,
            in_stream=int(xlen),
            filtered=c.filtered,
            unread=int(unread),
            discarded=c.discarded,
        )


class RunWriting(Leasing):
    """What the learner writes of the run's state, each write through its fence (:meth:`Leasing.write`)."""

    def announce_weights(self, ann: WeightsAnnouncement) -> None:
        """Update ``weights:latest`` and publish the version on the ``weights`` channel, atomically."""
        fields = [x for kv in ann.to_hash().items() for x in kv]
        self.write(
            ("DEL", self.keys.weights_latest),  # no field of an earlier build's announcement outlives it
            ("HSET", self.keys.weights_latest, *fields),
            ("PUBLISH", None, self.keys.weights_channel, weights_wakeup(ann.version)),
        )

    def mark_done(self) -> None:
        self.write(("SET", self.keys.done, DoneMark(self.server_time()).encode()))

    def clear_done(self) -> None:
        self.write(("DEL", self.keys.done))

    def create_identity(self, run_id: str) -> None:
        """Name the run in Redis (kept if another learner named it first)."""
        first = RunIdentity.first_fields(run_id, self.server_time())
        self.write(*(("HSETNX", self.keys.identity, name, value) for name, value in first.items()))

    def record_reset(self, run_id: str, step: int, trained_before: int) -> None:
        """Name the run again in a Redis that lost its data, recording the loss: when, at which learner step, and
        how many groups had been trained before it (no longer in ``stats``; ``grpo status`` reports them)."""
        now = self.server_time()
        reset = RunIdentity.reset_fields(run_id, now, step, trained_before)
        first = RunIdentity.first_fields(run_id, now)  # id is set by the HSET: created_at, if absent
        self.write(
            ("HSET", self.keys.identity, *(x for kv in reset.items() for x in kv)),
            *(("HSETNX", self.keys.identity, name, value) for name, value in first.items()),
            ("HINCRBY", self.keys.identity, "resets", 1),
        )


class RunAdmin(Connection):
    """What the operator reads and clears of the runs in a Redis (``grpo run``, ``grpo status``)."""

    def started_signs(self) -> tuple[bool, int]:
        """Whether weights are announced (the learner has loaded its model) and how many groups actors have sent:
        one round trip, for a view of the run's start-up."""

        def build(pipe: Any) -> None:
            pipe.exists(self.keys.weights_latest)
            pipe.hget(self.keys.stats, PRODUCED)

        announced, produced = self._batch(build, transaction=False)
        return bool(announced), int(produced or 0)

    def run_seen(self) -> bool:
        """Whether Redis holds any key of this run: its identity (a learner started), counters or stream (an actor
        sent groups), the prompt cursor or a reserved round (an actor is sampling its first), dead letters, an
        announcement or the done mark. One EXISTS: the keys share one slot."""
        k = self.keys
        keys = (k.identity, k.stats, k.groups, k.prompts_cursor, k.inflight, k.dead, k.weights_latest, k.done,
                k.filtered, k.prompts_record)  # fmt: skip
        return bool(self._do(lambda: self.client.exists(*keys)))

    def run_names(self, max_scans: int) -> list[str]:
        """The names of the runs with keys in this Redis, sorted, from at most ``max_scans`` SCAN calls of 1000 keys:
        a hint, not an inventory. ``redis.ResponseError`` where this user may not SCAN (an ACL user limited to its
        run's keys)."""
        names: set[str] = set()
        cursor = 0
        for _ in range(max_scans):
            cursor, found = self.client.scan(cursor, match="grpo:{*}:*", count=1000)
            names.update(m.group(1) for key in found if (m := re.match(r"grpo:\{(.*?)\}:", as_text(key))))
            if cursor == 0:
                break
        return sorted(names)

    def delete_run(self) -> None:
        """Remove every key of this run (used before a fresh run under a reused name)."""
        keys: Iterable[bytes] = list(self.client.scan_iter(match=self.keys.prefix + "*", count=500))
        if keys:
            self._do(lambda: self.client.delete(*keys))


def read_balance(t: RunReading) -> Balance:
    """The accounting equation of DESIGN §4, read from Redis alone (see :meth:`RunReading.balance`)."""
    return t.balance()
