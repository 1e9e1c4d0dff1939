"""A Redis that refuses commands for now, against a real redis-server: what it refuses, in which forms redis-py raises
it, and that a refused command, transaction or script changed nothing (which the transport's retry relies on,
Connection._do); then the transport waiting a full Redis out (a round written once, the counters read, the lease
renewed meanwhile), giving up past ``redis.full_wait_s`` with RedisUnavailable, and the other refusals (short of
replicas, unable to persist, a replica without its primary, busy with a script) recognised and waited out too."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from common.config import RedisConfig
from common.ports import free_port
from common.schemas import LeaseHolder
from common.transport import RedisUnavailable, Transport, read_balance, refusal
from ops.redis_server import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture
def admin(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def fill(admin: redis.Redis) -> None:
    """Full: ``maxmemory`` below any memory Redis uses (the fault test sets it just below), nothing evicted."""
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)


def lift(admin: redis.Redis) -> None:
    admin.config_set("maxmemory", 0)


def code(call: Callable[[], Any]) -> str | None:
    """The refusal ``call`` met (its code), or None when it ran."""
    try:
        call()
    except redis.RedisError as e:
        found = refusal(e)
        assert found is not None, e
        return found.code
    return None


def test_a_full_redis_refuses_before_changing_anything(admin: redis.Redis) -> None:
    admin.hset("h", "n", 1)
    admin.set("k", 1)
    fill(admin)
    try:
        assert code(lambda: admin.set("other", 1)) == "OOM"  # a command that may grow memory
        assert code(lambda: admin.get("k")) is None and code(lambda: admin.pexpire("k", 60_000)) is None

        def transaction() -> None:  # every command queued in MULTI is refused, a DEL and a read too: none runs
            pipe = admin.pipeline(transaction=True)
            pipe.delete("k")
            pipe.hgetall("h")
            pipe.execute()

        assert code(transaction) == "OOM" and admin.exists("k")

        # A script is refused at its first write that may grow memory while it has written nothing...
        first_write = admin.register_script("redis.call('HINCRBY', KEYS[1], 'n', 1) redis.call('DEL', KEYS[2])")
        assert code(lambda: first_write(keys=["h", "k"])) == "OOM"  # (loaded under OOM: SCRIPT LOAD is no write)
        assert admin.hget("h", "n") == b"1" and admin.exists("k")
        # ...and never once it has written (here a DEL): Redis does not stop a script half way. So a refused script
        # wrote nothing, and running it again is running it once.
        wrote_first = admin.register_script("redis.call('DEL', KEYS[2]) redis.call('HINCRBY', KEYS[1], 'n', 1)")
        assert code(lambda: wrote_first(keys=["h", "k"])) is None
        assert admin.hget("h", "n") == b"2" and not admin.exists("k")
    finally:
        lift(admin)


def patient(url: str, full_wait_s: float = 600) -> Transport:
    return Transport(RedisConfig(url=url, backoff_max_s=0.2, full_wait_s=full_wait_s), "r")


def later(seconds: float, action: Callable[[], object]) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_transport_waits_a_full_redis_out(redis_url: str, admin: redis.Redis, caplog) -> None:  # type: ignore[no-untyped-def]
    t = patient(redis_url)
    t.ensure_consumer_group()
    assert t.acquire_lease(LeaseHolder(0, "l", "h", 1, 0.0), ttl_s=30, floor=0) is None
    fill(admin)
    lifted = later(1.5, lambda: lift(admin))
    try:
        assert t.renew_lease() is False  # the lease is kept meanwhile: PEXPIRE is not refused
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="common.transport"):
            assert t.produce([b"a", b"b"], {"groups_filtered:zero_std": 1}) is not None
        assert time.monotonic() - t0 >= 1.0  # it waited for room in Redis
        lines = [r.getMessage() for r in caplog.records]
        assert any("Redis is full" in m and "attempt 1/" in m and "raise maxmemory" in m for m in lines), lines
    finally:
        lifted.join()
    # Written once, though refused several times.
    assert t.client.xlen(t.keys.groups) == 2 and t.stats() == {"groups_produced": 2, "groups_filtered:zero_std": 1}

    fill(admin)  # the counters' transaction (the learner reads it every step) and a heartbeat wait too
    lifted = later(1.0, lambda: lift(admin))
    b = read_balance(t)
    t.heartbeat("a1", 30, {"version": 0, "groups_sent": 2, "rounds": 1})
    lifted.join()
    assert b.produced == 2 and b.unexplained == 0 and t.client.exists(t.keys.actor("a1"))
    t.close()


def test_past_full_wait_s_it_stops_in_one_line(redis_url: str, admin: redis.Redis) -> None:
    errors: list[int] = []
    cfg = RedisConfig(url=redis_url, backoff_max_s=0.1, full_wait_s=0.5)
    t = Transport(cfg, "r", on_error=lambda: errors.append(1))
    fill(admin)
    try:
        with pytest.raises(RedisUnavailable, match=r"Redis is full .* for redis.full_wait_s \(0.5s\)"):
            t.produce([b"a"])
    finally:
        lift(admin)
    assert t.client.xlen(t.keys.groups) == 0 and len(errors) == 6  # 5 pauses of 0.1 s: 6 attempts, each counted
    t.close()


def refused_forms(admin: redis.Redis, key: str, *, reads: bool = False) -> list[str | None]:
    """The refusal a plain write, a transaction holding one and a script whose first write is a PEXPIRE meet (with
    ``reads``: a read, a transaction of reads, a script that reads)."""

    def transaction() -> None:
        pipe = admin.pipeline(transaction=True)
        pipe.get(key)
        if reads:
            pipe.get(key)
        else:
            pipe.set(key, 2)
        pipe.execute()

    ttl_first = admin.register_script("redis.call('PEXPIRE', KEYS[1], 60000) redis.call('SET', KEYS[1], 3)")
    reader = admin.register_script("return redis.call('GET', KEYS[1])")
    if reads:
        return [code(lambda: admin.get(key)), code(transaction), code(lambda: reader(keys=[key]))]
    return [code(lambda: admin.set(key, 1)), code(transaction), code(lambda: ttl_first(keys=[key]))]


def test_too_few_replicas_and_a_disk_that_fails_are_refusals_too(redis_url: str, admin: redis.Redis) -> None:
    admin.set("k", 0)
    admin.config_set("min-replicas-to-write", 1)  # none is connected
    try:
        assert refused_forms(admin, "k") == ["NOREPLICAS"] * 3
        assert admin.get("k") == b"0" and admin.ttl("k") == -1  # the refused script wrote nothing
        t = patient(redis_url)
        lifted = later(1.0, lambda: admin.config_set("min-replicas-to-write", 0))
        assert t.produce([b"a"]) is not None  # waited out
        lifted.join()
        t.close()
    finally:
        admin.config_set("min-replicas-to-write", 0)


def test_a_redis_that_cannot_persist_refuses_writes(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "r").start()
    admin = redis.Redis.from_url(server.url)
    try:
        gone = tmp_path / "gone"
        gone.mkdir()
        admin.config_set("dir", str(gone))
        shutil.rmtree(gone)  # its snapshot cannot be written: Redis stops writes (stop-writes-on-bgsave-error)
        admin.config_set("save", "3600 1")
        admin.set("k", 0)
        admin.bgsave()
        deadline = time.monotonic() + 10
        while admin.info("persistence")["rdb_last_bgsave_status"] != "err" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert refused_forms(admin, "k") == ["MISCONF"] * 3
        assert admin.get("k") == b"0" and admin.ttl("k") == -1
    finally:
        admin.close()
        server.stop()


def test_a_replica_without_its_primary_refuses_reads_too(admin: redis.Redis) -> None:
    """(Writes get READONLY there, as from any replica: Sentinel's pool reconnects to the primary on it.)"""
    admin.set("k", 0)
    admin.config_set("replica-serve-stale-data", "no")
    admin.replicaof("127.0.0.1", free_port())  # a primary that is not there
    try:
        deadline = time.monotonic() + 5
        while code(lambda: admin.get("k")) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert refused_forms(admin, "k", reads=True) == ["MASTERDOWN"] * 3
    finally:
        admin.replicaof("no", "one")
    assert admin.get("k") == b"0"


def test_a_busy_redis_is_waited_out_by_the_weights_channel(redis_url: str, admin: redis.Redis) -> None:
    """A script running past ``lua-time-limit`` makes Redis answer BUSY to every other command: the SUBSCRIBE, and
    the PING redis-py checks the channel's connection with; neither ends the subscription."""
    admin.config_set("lua-time-limit", 100)
    busy = redis.Redis.from_url(redis_url, socket_timeout=10)
    spin = ("local t = redis.call('TIME') while true do local n = redis.call('TIME') "
            "if (n[1] - t[1]) * 1000000 + n[2] - t[2] > tonumber(ARGV[1]) then return 1 end end")  # fmt: skip

    def run_busy(micros: int) -> threading.Thread:
        thread = threading.Thread(target=lambda: busy.eval(spin, 0, micros), daemon=True)
        thread.start()
        time.sleep(0.3)  # past the limit: Redis is BUSY
        return thread

    t = patient(redis_url)
    spinning = run_busy(1_500_000)
    assert code(lambda: admin.get("k")) == "BUSY"
    channel = t.subscribe_weights()  # refused, waited out
    spinning.join()
    spinning = run_busy(1_000_000)
    channel._pubsub.connection.next_health_check = 0  # type: ignore[attr-defined]  # a PING now, refused
    assert channel.get_message(timeout=0.5) is None
    spinning.join()
    admin.publish(t.keys.weights_channel, b"7")
    deadline = time.monotonic() + 5
    while (msg := channel.get_message(timeout=0.5)) is None and time.monotonic() < deadline:
        pass
    assert msg is not None and msg["data"] == b"7"
    channel.close()
    busy.close()
    t.close()
