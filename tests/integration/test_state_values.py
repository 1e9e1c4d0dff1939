"""The run's state as a real Redis holds it, read back through the wire package's forms (common.schemas.state): what
the transport and its Lua scripts write is exactly what the forms read, field by field."""

from __future__ import annotations

import time

import pytest

from common.config import RedisConfig
from common.schemas import (
    FORWARDED,
    DeadLetter,
    DoneMark,
    Reservation,
    RunCounters,
    RunIdentity,
    WeightsAnnouncement,
    counter,
    weights_wakeup,
)
from common.transport import Admission, Transport
from common.transport.delivery import ReadLimits

pytestmark = pytest.mark.integration


def test_every_counter_a_script_bumps_is_one_the_form_reads(redis_url: str) -> None:
    t = Transport(RedisConfig(url=redis_url, retries=1), "state")
    t.ensure_consumer_group()
    t.produce([b"a", b"b", b"c", b"d"], {counter("filtered", "zero_std"): 3, FORWARDED: 1})
    t.produce([], {counter("discarded", "stopped"): 2})
    a, b, c, _unread = t.read("l", 4, 100)
    t.ack_trained([a.id], ["g-a"], step=1)
    t.drop([b.id], "stale")
    t.dead_letter(c, "not a group")
    t.produce([b"x" * 100])
    t.read("l", 1, 100, ReadLimits(max_bytes=10, budget_bytes=1000))  # oversized: dead-lettered inside Redis
    (letter, oversized) = t.dead_letters(10)
    assert t.replay_dead(letter.id) is not None
    assert t.counters() == RunCounters(produced=6, trained=1, dead=2, replayed=1, forwarded=1, dropped={"stale": 1},
                                       filtered={"zero_std": 3}, discarded={"stopped": 2})  # fmt: skip
    assert t.stats() == {k.decode(): int(v) for k, v in t.client.hgetall(t.keys.stats).items()}
    b_ = t.balance()
    assert (b_.produced, b_.trained, b_.dead, b_.in_stream, b_.unexplained) == (6, 1, 2, 2, 0), b_.equation()
    assert letter == DeadLetter(letter.id, "not a group", b"c", c.id, letter.at, 1)
    assert abs(letter.at - time.time()) < 60 and abs(oversized.at - t.server_time()) < 60
    assert oversized.truncated and oversized.size == 100 and oversized.payload == b"x" * 100
    assert oversized.reason == "oversized: 100 bytes, over the limit of 10 (redis.max_message_bytes)"
    t.close()


def test_identity_done_mark_reservation_and_wakeup_as_written(redis_url: str) -> None:
    t = Transport(RedisConfig(url=redis_url, retries=1), "state")
    assert t.identity() is None
    t.create_identity("r1")
    t.create_identity("r2")  # another learner came second: the first name stays
    first = t.identity()
    assert first is not None and first.id == "r1" and abs(first.created_at - t.server_time()) < 5
    t.record_reset("r1", 7, 56)
    t.record_reset("r1", 9, 72)
    after = t.identity()
    assert after is not None and after.reset_at is not None
    assert after == RunIdentity("r1", first.created_at, after.reset_at, 9, 72, 2)
    assert first.created_at <= after.reset_at and abs(after.reset_at - t.server_time()) < 5

    t.mark_done()
    done = DoneMark.decode(t.client.get(t.keys.done))
    assert t.is_done() and abs(done.at - t.server_time()) < 5

    now_ms = t.server_time() * 1000
    assert t.reserve_round("a1", 8, 0, Admission(bound=64, batch_groups=8, max_staleness=2), lease_s=30)
    held = Reservation.decode(t.client.hget(t.keys.inflight, "a1"))
    assert held.groups == 8 and now_ms + 29_000 <= held.lease_end_ms <= now_ms + 31_000, (held, now_ms)
    t.renew_reservation("a1", 60)
    renewed = Reservation.decode(t.client.hget(t.keys.inflight, "a1"))
    assert renewed.groups == 8 and renewed.lease_end_ms >= held.lease_end_ms + 29_000

    ps = t.subscribe_weights()
    ps.get_message(timeout=1)
    t.announce_weights(WeightsAnnouncement(5, "/w/v000005", "xxh3-128:" + "a" * 32))
    msg = ps.get_message(timeout=2)
    assert msg is not None and msg["data"] == weights_wakeup(5).encode()
    ps.close()
    t.close()
