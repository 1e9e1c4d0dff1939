"""The learner's lease and fence (common.transport.lease) against a real redis-server: one holder at a time, tokens
that grow, and every write of a learner that lost the run refused by Redis, leaving every key as it was."""

from __future__ import annotations

import time

import pytest

from common.config import RedisConfig
from common.schemas import LeaseHolder, NcclRound, WeightsAnnouncement
from common.transport import LeaseLost, StreamEntry, Transport, read_balance

pytestmark = pytest.mark.integration


def transport(url: str) -> Transport:
    return Transport(RedisConfig(url=url, retries=1), "lease")


def me(name: str) -> LeaseHolder:
    return LeaseHolder(0, name, "host-" + name, 100, 0.0)


def a_round(seq: int) -> NcclRound:
    return NcclRound("s", seq, 1, "g", "127.0.0.1", 1, 2, "gloo", {"a1": 1})


def snapshot(t: Transport) -> dict[bytes, bytes | None]:
    """Every key of the run, dumped (values, TTLs aside): what a refused write must leave as it was."""
    return {k: t.client.dump(k) for k in sorted(t.client.keys("*")) if not k.endswith(b"learner:lease")}


def test_one_holder_and_tokens_that_grow(redis_url: str) -> None:
    a, b = transport(redis_url), transport(redis_url)
    assert a.acquire_lease(me("a"), 30, floor=0) is None and a.lease_token() == 1
    held = b.acquire_lease(me("b"), 30, floor=0)
    assert held is not None and (held.holder, held.host, held.token) == ("a", "host-a", 1)
    assert held.ttl_s is not None and 25 < held.ttl_s <= 30
    assert b.lease_token() == 0  # it holds nothing: its writes are not fenced, and it writes nothing
    assert a.acquire_lease(me("a"), 30, floor=0) is None and a.lease_token() == 1  # a retried call: still its own
    a.release_lease()
    assert b.acquire_lease(me("b"), 30, floor=0) is None and b.lease_token() == 2
    h = a.lease_holder()
    assert h is not None and (h.holder, h.token) == ("b", 2)
    # After Redis lost its data, the floor (the highest token the run's files carry) keeps tokens growing.
    b.client.flushall()
    c = transport(redis_url)
    assert c.acquire_lease(me("c"), 30, floor=7) is None and c.lease_token() == 8


def test_a_learner_that_lost_the_run_has_every_write_refused(redis_url: str) -> None:
    old, new = transport(redis_url), transport(redis_url)
    assert old.acquire_lease(me("old"), 1, floor=0) is None
    old.ensure_consumer_group()
    old.produce([b"g1", b"g2", b"g3"])
    got = old.read("learner-old", 2, 100)
    assert len(got) == 2
    time.sleep(1.2)  # old is frozen past its lease
    assert new.acquire_lease(me("new"), 30, floor=0) is None and new.lease_token() == 2
    before = snapshot(new)
    entry = StreamEntry(got[0].id, {b"data": b"g1"})
    writes = {
        "ensure_consumer_group": lambda: old.ensure_consumer_group(),
        "read": lambda: old.read("learner-old", 1, 10),
        "fetch": lambda: old.fetch("learner-old", [got[0].id], 1),
        "claim_pending": lambda: old.claim_pending("learner-old"),
        "ack_trained": lambda: old.ack_trained([got[0].id], ["g1"], 1),
        "drop": lambda: old.drop([got[1].id], "stale"),
        "dead_letter": lambda: old.dead_letter(entry, "bad"),
        "announce_weights": lambda: old.announce_weights(WeightsAnnouncement(9, "/w/v9", "xxh3-128:" + "a" * 32)),
        "mark_done": lambda: old.mark_done(),
        "clear_done": lambda: old.clear_done(),
        "create_identity": lambda: old.create_identity("run-x"),
        "record_reset": lambda: old.record_reset("run-x", 3, 10),
        "nccl_open_round": lambda: old.nccl_open_round(a_round(1)),
        "nccl_decide": lambda: old.nccl_decide("s:1", "go"),
        "renew_lease": lambda: old.renew_lease(),
    }
    for name, write in writes.items():
        with pytest.raises(LeaseLost, match="no longer holds the run"), _named(name):
            write()
        assert snapshot(new) == before, f"{name} changed the run"
    old.release_lease()  # not its lease: the holder keeps it
    h = new.lease_holder()
    assert h is not None and h.token == 2
    # The holder's writes go through.
    new.ack_trained([got[0].id], ["g1"], 1)
    assert read_balance(new).trained == 1


def test_a_lapsed_lease_nobody_took_is_taken_again(redis_url: str) -> None:
    """A learner (or Redis) frozen past the lease while no other learner started, or a Redis that lost its data:
    the same holder goes on with the same token, since nobody wrote in between."""
    t = transport(redis_url)
    assert t.acquire_lease(me("a"), 1, floor=0) is None
    time.sleep(1.2)
    assert t.lease_holder() is None
    t.mark_done()  # the fence finds the lease lapsed, the holder takes it again, the write goes through
    assert t.is_done()
    h = t.lease_holder()
    assert h is not None and (h.holder, h.token) == ("a", 1)
    t.client.flushall()  # Redis lost everything, the token counter with it
    t.ensure_consumer_group()
    h = t.lease_holder()
    assert h is not None and (h.holder, h.token) == ("a", 1)
    other = transport(redis_url)
    assert other.acquire_lease(me("b"), 30, floor=0) is not None  # held again: a second learner waits
    # Redis lost its data again, but the run's files show a later holder (a marker of token 5): that one took the run
    # over while this learner was frozen, so it may not take the lease again.
    t.lease_floor = lambda: 5
    t.client.flushall()
    with pytest.raises(LeaseLost, match="lease token 5 took the run over"):
        t.mark_done()
    assert t.client.keys("*") == []


def test_processes_without_a_lease_write_unfenced(redis_url: str) -> None:
    """Actors and operators hold no lease: the scripts they share with the learner run for them as before, whoever
    holds the run."""
    holder, actor = transport(redis_url), transport(redis_url)
    assert holder.acquire_lease(me("a"), 30, floor=0) is None
    actor.ensure_consumer_group()
    actor.produce([b"g"])
    actor.nccl_register("a1", {"ranks": 1})
    assert read_balance(actor).produced == 1


class _named:
    """Names the write in a failure (pytest.raises alone does not)."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, value: object, tb: object) -> bool:
        if kind is None:
            raise AssertionError(f"{self.name}: not refused")
        return False


def test_each_script_name_is_one_script() -> None:
    """The transport's parts share one object: two scripts under one attribute name, in two parts, would run the
    first part's for both (a lease renewal once ran the reservations' script)."""
    from common.transport.connection import Lua

    seen: dict[str, str] = {}
    for part in Transport.__mro__:
        for name, value in vars(part).items():
            if isinstance(value, Lua):
                assert seen.setdefault(name, value.source) == value.source, f"{name} names two scripts"
