"""common.transport against a real redis-server: the stream contract, dead letters, weights, and the accounting."""

from __future__ import annotations

import time

import pytest
import redis

from common.config import RedisConfig
from common.schemas import Heartbeat, NcclRound, WeightsAnnouncement
from common.transport import Transport, TransportError, read_balance

pytestmark = pytest.mark.integration


def transport(url: str, run: str = "t") -> Transport:
    return Transport(RedisConfig(url=url, retries=1), run)


def test_keys_live_under_the_run_hash_tag(redis_url: str) -> None:
    t = transport(redis_url, "my-run")
    t.ensure_consumer_group()
    t.produce([b"x"], {"groups_filtered:zero_std": 2})
    t.take_name("a1")
    t.next_prompts(3, "a1", 5)
    t.record_outcomes([("p1", "m")], 4, {"taken:unseen": 1})
    t.heartbeat("a1", 5, {})
    t.announce_weights(WeightsAnnouncement(1, "/w/v1", "xxh3-128:" + "a" * 32))
    t.mark_done()
    t.nccl_register("a1", {"ranks": 1})
    t.nccl_open_round(a_round("s", 1))
    t.nccl_ready("s:1", "a1")
    t.nccl_decide("s:1", "go")
    keys = sorted(k.decode() for k in t.client.keys("*"))
    assert keys == [
        "grpo:{my-run}:actor_ids",
        "grpo:{my-run}:actors:a1",
        "grpo:{my-run}:done",
        "grpo:{my-run}:groups",
        "grpo:{my-run}:nccl:members",
        "grpo:{my-run}:nccl:ready",
        "grpo:{my-run}:nccl:round",
        "grpo:{my-run}:nccl:state",
        "grpo:{my-run}:prompts:choices",
        "grpo:{my-run}:prompts:claims",
        "grpo:{my-run}:prompts:cursor",
        "grpo:{my-run}:prompts:last",
        "grpo:{my-run}:prompts:record",
        "grpo:{my-run}:stats",
        "grpo:{my-run}:weights:latest",
    ]


def test_produce_read_ack_balances(redis_url: str) -> None:
    t = transport(redis_url)
    t.ensure_consumer_group()
    ids = t.produce([b"g1", b"g2", b"g3"], {"groups_filtered:zero_std": 5})
    assert len(ids) == 3 and t.stream_length() == 3
    got = t.read("learner-1", count=10, block_ms=100)
    assert [e.payload for e in got] == [b"g1", b"g2", b"g3"]
    assert t.client.xpending(t.keys.groups, "learners")["pending"] == 3
    b = read_balance(t)
    assert (b.produced, b.trained, b.in_stream, b.unexplained) == (3, 0, 3, 0)
    t.ack_trained([got[0].id, got[1].id], ["g1", "g2"])
    t.drop([got[2].id], "stale")
    b = read_balance(t)
    assert (b.trained, b.dropped, b.in_stream, b.filtered, b.unexplained) == (2, {"stale": 1}, 0, {"zero_std": 5}, 0)
    assert t.stream_length() == 0 and t.client.xpending(t.keys.groups, "learners")["pending"] == 0
    assert "balanced" in b.equation()


def test_dead_letter_keeps_reason_and_raw_payload(redis_url: str) -> None:
    t = transport(redis_url)
    t.ensure_consumer_group()
    t.produce([b"\xc1garbage"])
    (entry,) = t.read("l", 1, 100)
    t.dead_letter(entry, "not msgpack: boom")
    ((_, fields),) = t.client.xrange(t.keys.dead)
    assert fields[b"reason"] == b"not msgpack: boom" and fields[b"payload"] == b"\xc1garbage"
    assert fields[b"source_id"].decode() == entry.id
    b = read_balance(t)
    assert (b.dead, b.in_stream, b.unexplained) == (1, 0, 0)


def test_a_new_learner_reclaims_what_a_dead_one_left_pending(redis_url: str) -> None:
    t = transport(redis_url)
    t.ensure_consumer_group()
    t.produce([b"a", b"b", b"c"])
    t.read("learner-dead", 2, 100)  # read, never acked: the process "died"
    claimed = t.claim_pending("learner-new")  # ids only: nothing is loaded yet
    assert t.stranded("learner-new", set()) == claimed
    reclaimed = t.fetch("learner-new", claimed, 10)
    assert [e.payload for e in reclaimed] == [b"a", b"b"] and reclaimed.taken == 2
    rest = t.read("learner-new", 10, 100)
    assert [e.payload for e in rest] == [b"c"]
    t.ack_trained([e.id for e in reclaimed + rest], ["a", "b", "c"])
    assert read_balance(t).unexplained == 0


def test_groups_produced_before_the_consumer_group_exists_are_not_skipped(redis_url: str) -> None:
    t = transport(redis_url)
    t.produce([b"early"])
    t.ensure_consumer_group()
    t.ensure_consumer_group()  # idempotent
    assert [e.payload for e in t.read("l", 5, 100)] == [b"early"]


def test_weights_announcement_hash_and_pubsub(redis_url: str) -> None:
    t = transport(redis_url)
    assert t.latest_weights() is None
    ps = t.subscribe_weights()
    ps.get_message(timeout=1)  # drain nothing; subscription is active
    # An earlier build's announcement (a sha256 field, no digest) is read, and replaced whole by the next one.
    t.client.hset(t.keys.weights_latest, mapping={"version": "3", "uri": "/w/v000003", "sha256": "c" * 64,
                                                  "format": "hf-safetensors", "published_at": "1.5"})  # fmt: skip
    assert t.latest_weights() == WeightsAnnouncement(3, "/w/v000003", "sha256:" + "c" * 64, published_at=1.5)
    ann = WeightsAnnouncement(4, "/w/v000004", "xxh3-128:" + "b" * 32)
    t.announce_weights(ann)
    assert t.latest_weights() == ann
    assert b"sha256" not in t.client.hgetall(t.keys.weights_latest)
    msg = ps.get_message(timeout=2)
    assert msg is not None and msg["data"] == b"4"
    ps.close()


def a_round(session: str, seq: int) -> NcclRound:
    return NcclRound(session, seq, 1, "g", "127.0.0.1", 29500, 2, "gloo", {"a1": 1})


def test_update_group_members_age_out_and_decisions_belong_to_one_round(redis_url: str) -> None:
    t = transport(redis_url)
    t.nccl_register("a1", {"ranks": 2, "nonce": "n1", "group": None})
    t.nccl_register("a2", {"ranks": 1, "nonce": "n2", "group": "g"})
    t.client.hset(t.keys.nccl_members, "bad", b"not json")
    assert {m: d.ranks for m, d in t.nccl_members(5.0).items()} == {"a1": 2, "a2": 1}
    assert t.client.hexists(t.keys.nccl_members, "bad") == 0  # unreadable: removed
    time.sleep(1.2)
    t.nccl_register("a2", {"ranks": 1, "nonce": "n2", "group": "g"})
    assert set(t.nccl_members(1.0)) == {"a2"}  # a1 aged out (by Redis's clock) and was removed
    assert not t.client.hexists(t.keys.nccl_members, "a1")
    t.nccl_unregister("a2")
    assert t.nccl_members(5.0) == {}

    t.nccl_open_round(a_round("s1", 4))
    assert t.nccl_decision("s1:4") is None  # undecided
    t.nccl_ready("s1:4", "a1")
    t.nccl_ready("s1:3", "a2")  # late, for an earlier round
    assert t.nccl_ready_members("s1:4") == {"a1"}
    t.nccl_decide("s1:4", "join")
    assert t.nccl_decision("s1:4") == "join"
    t.nccl_decide("s1:4", "go")
    assert t.nccl_decision("s1:4") == "go"
    t.nccl_open_round(a_round("s1", 5))
    assert t.nccl_decision("s1:4") == "cancel"  # a later round of the learner
    assert t.nccl_ready_members("s1:5") == set()
    t.nccl_open_round(a_round("s2", 1))  # another learner (restarted): its round 1 is not ours
    assert t.nccl_decision("s1:1") == "cancel" and t.nccl_decision("s2:1") is None
    t.client.set(t.keys.nccl_round, b'{"session": "s2", "seq": 1}')  # not a whole round: nobody takes it
    assert t.nccl_decision("s2:1") == "cancel"
    t.nccl_open_round(a_round("s2", 2))
    t.client.set(t.keys.nccl_state, b"s2:2:maybe")  # an unreadable decision decides nothing
    assert t.nccl_decision("s2:2") is None


def test_two_actors_share_the_prompt_cursor(redis_url: str) -> None:
    a, b = transport(redis_url), transport(redis_url)
    ranges = [a.next_prompts(4, "a", 5), b.next_prompts(4, "b", 5), a.next_prompts(2, "a", 5, new_round=False)]
    assert ranges == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_heartbeat_expires(redis_url: str) -> None:
    t = transport(redis_url)
    t.heartbeat("actor-1", 0.3, {"version": 2})
    assert t.live_actors()["actor-1"].version == 2
    assert Heartbeat.decode(t.client.get(t.keys.actor("actor-1"))).version == 2  # the wire package's form
    time.sleep(0.6)
    assert t.live_actors() == {}


def test_unreachable_redis_is_a_clear_error() -> None:
    from common.ports import free_port

    t = Transport(RedisConfig(url=f"redis://127.0.0.1:{free_port()}/0", retries=1, socket_timeout_s=1), "t")
    with pytest.raises(TransportError, match="unreachable"):
        t.ping()
    with pytest.raises(TransportError, match="empty"):
        Transport(RedisConfig(url=""), "t")


def test_a_restarted_server_is_reconnected_to(redis_server) -> None:  # type: ignore[no-untyped-def]
    t = transport(redis_server.url)
    t.produce([b"x"])
    redis_server.restart()  # no persistence configured here: the data is gone, the connection comes back
    assert t.stream_length() == 0
    with pytest.raises(redis.ResponseError):
        t.client.execute_command("NOT-A-COMMAND")


def test_retries_are_bounded_logged_and_counted(redis_server, caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    counts = {"errors": 0, "reconnects": 0}
    t = Transport(
        RedisConfig(url=redis_server.url, retries=2, socket_timeout_s=1),
        "t",
        on_error=lambda: counts.__setitem__("errors", counts["errors"] + 1),
        on_reconnect=lambda: counts.__setitem__("reconnects", counts["reconnects"] + 1),
    )
    t.ping()
    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="common.transport"), pytest.raises(redis.ConnectionError):
        t.stream_length()
    messages = [r.getMessage() for r in caplog.records]
    assert any("attempt 1/3, reconnecting" in m for m in messages), messages
    assert any("attempt 3/3, giving up" in m for m in messages), messages
    assert counts == {"errors": 1, "reconnects": 3}


def test_settling_twice_counts_once(redis_url: str) -> None:
    """A settle retried after its reply was lost must not count a group twice: the equation would break."""
    t = transport(redis_url)
    t.ensure_consumer_group()
    t.produce([b"a", b"b", b"c"])
    a, b, c = t.read("l", 3, 100)
    for _ in range(2):
        t.ack_trained([a.id], ["ga"])
        t.drop([b.id], "stale")
        t.dead_letter(c, "bad")
    bal = read_balance(t)
    assert (bal.trained, bal.dropped, bal.dead, bal.unexplained) == (1, {"stale": 1}, 1, 0)
    assert t.client.xlen(t.keys.dead) == 1


def test_own_pending_entries_are_read_again(redis_url: str) -> None:
    """Entries delivered to this consumer but never settled (a lost reply, or taken over) are not stranded; those
    it knows it holds (trained, waiting for a checkpoint) are not read again."""
    t = transport(redis_url)
    t.ensure_consumer_group()
    t.produce([b"a", b"b", b"c"])
    held = t.read("l", 1, 100)  # trained, waiting for its checkpoint
    t.read("l", 2, 100)  # the reply "was lost"
    assert t.read("l", 2, 100) == []  # new entries only: nothing
    known = {e.id for e in held}
    assert [e.payload for e in t.fetch("l", t.stranded("l", known), 10)] == [b"b", b"c"]
    assert t.stranded("l", known | set(t.stranded("l", known))) == []
    t.produce([b"d"])
    assert t.stranded("other", set()) == []  # another consumer's entries are not its own


def test_a_wrong_password_is_reported_at_once(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    from ops.redis_server import RedisServer

    server = RedisServer(tmp_path / "r").start()
    try:
        server_client = redis.Redis.from_url(server.url)
        server_client.config_set("requirepass", "right")
        server_client.close()
        t = Transport(RedisConfig(url=server.url, password="wrong", retries=5), "t")
        with caplog.at_level(logging.WARNING, logger="common.transport"), pytest.raises(TransportError, match="auth"):
            t.ping()
        assert not [r for r in caplog.records if "reconnecting" in r.getMessage()]
    finally:
        server.stop()


def test_bounded_produce_never_overshoots_and_refuses_whole_rounds(redis_url: str) -> None:
    t = transport(redis_url)
    t.ensure_consumer_group()
    assert t.produce([b"x"] * 5, bound=4) is not None  # an empty stream takes any round
    assert t.produce([b"y"], {"groups_filtered:zero_std": 3}, bound=4) is None  # 5 unread: refused, nothing counted
    assert t.stats() == {"groups_produced": 5}
    t.read("l", 3, 100)  # read groups are pending, not unread: room for 2 more
    assert t.unread() == 2
    assert t.produce([b"a", b"b"], bound=4) is not None
    assert t.produce([b"c"], bound=4) is None
    assert (t.unread(), t.stream_length(), t.stats()["groups_produced"]) == (4, 7, 7)


def test_many_producers_together_respect_the_bound(redis_url: str) -> None:
    import threading

    t = transport(redis_url)
    t.ensure_consumer_group()
    sent = []

    def actor() -> None:
        mine = transport(redis_url)
        for _ in range(20):
            if mine.produce([b"g"] * 3, bound=10) is not None:
                sent.append(3)

    threads = [threading.Thread(target=actor) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t.unread() == sum(sent) <= 10


def test_trained_group_ids_are_remembered_for_a_window(redis_url: str) -> None:
    t = transport(redis_url)
    t.ensure_consumer_group()
    t.produce([b"a", b"b", b"c"])
    a, b, c = t.read("l", 3, 100)
    t.ack_trained([a.id], ["ga"], step=1, window=5)
    t.ack_trained([b.id, c.id], ["gb", "gc"], step=7, window=5)  # step 1 is now outside the window
    assert t.trained_before(["ga", "gb", "gc", "gx"]) == [False, True, True, False]
    assert read_balance(t).trained == 3
