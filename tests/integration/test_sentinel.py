"""A replicated Redis behind Sentinel: a primary, its replica and a sentinel, all real processes on loopback. The
transport finds the primary through ``redis+sentinel://``, and when the primary is killed it carries on against the
replica that Sentinel promotes, with what was replicated before the kill."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from common.children import stop_process, wait_until
from common.config import ConfigError, RedisConfig, load_config, mask_url
from common.ports import free_port
from common.transport import CONSUMER_GROUP, Transport, parse_sentinel_url
from ops.redis_server import RedisServer, find_redis_server

NAME = "grpo-primary"


class Replicated:
    def __init__(self, root: Path):
        self.primary = RedisServer(root / "primary").start()
        self.replica = RedisServer(
            root / "replica", extra_args=["--replicaof", "127.0.0.1", str(self.primary.port)]
        ).start()
        self.sentinel_port = free_port()
        conf = root / "sentinel.conf"  # sentinel rewrites its config file as it learns: it must be writable
        conf.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {root}\n"
            f"sentinel monitor {NAME} 127.0.0.1 {self.primary.port} 1\n"
            f"sentinel down-after-milliseconds {NAME} 500\nsentinel failover-timeout {NAME} 5000\n"
        )
        with (root / "sentinel.log").open("ab") as log:
            self.sentinel = subprocess.Popen(
                [find_redis_server(), str(conf), "--sentinel"], stdout=log, stderr=subprocess.STDOUT
            )
        client = redis.Redis(port=self.sentinel_port)
        try:  # the sentinel knows the primary and has found its replica
            assert wait_until(lambda: self._replicas(client) == 1, 20), (root / "sentinel.log").read_text()
        finally:
            client.close()

    @staticmethod
    def _replicas(client: redis.Redis) -> int:
        try:
            return len(client.sentinel_slaves(NAME))
        except redis.RedisError:
            return 0

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{NAME}/0"

    def stop(self) -> None:
        stop_process(self.sentinel, grace_s=5, name="redis-sentinel")
        self.replica.stop()
        self.primary.stop()


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[Replicated]:
    r = Replicated(tmp_path)
    try:
        yield r
    finally:
        r.stop()


def test_the_transport_follows_a_failover(replicated: Replicated) -> None:
    t = Transport(RedisConfig(url=replicated.url, retries=12, backoff_max_s=2.0), "sentinel-run")
    try:
        t.ensure_consumer_group()
        assert t.produce([b"one", b"two"]) is not None
        assert t.client.execute_command("WAIT", 1, 5000) == 1  # both groups reached the replica
        replica_port = replicated.replica.port

        replicated.primary.kill()  # SIGKILL: the sentinel sees it down after 0.5 s and promotes the replica
        assert t.produce([b"three"]) is not None  # retried until the promoted replica answers
        sentinel = redis.Redis(port=replicated.sentinel_port)
        assert int(sentinel.sentinel_get_master_addr_by_name(NAME)[1]) == replica_port  # it was a failover
        sentinel.close()

        entries = t.read("learner", 10, 1000)
        assert [e.payload for e in entries] == [b"one", b"two", b"three"]
        t.ack_trained([e.id for e in entries], ["g1", "g2", "g3"], step=1)
        assert t.stats() == {"groups_produced": 3, "groups_trained": 3}
        assert t.client.xinfo_groups(t.keys.groups)[0]["name"].decode() == CONSUMER_GROUP
    finally:
        t.close()


def test_sentinel_urls_parse_and_mask() -> None:
    s = parse_sentinel_url("rediss+sentinel://user:p%40ss@s1:26380,s2,10.0.0.3:5000/my-primary/2")
    assert s.hosts == [("s1", 26380), ("s2", 26379), ("10.0.0.3", 5000)]
    assert (s.service, s.db, s.username, s.password, s.tls) == ("my-primary", 2, "user", "p@ss", True)
    assert parse_sentinel_url("redis+sentinel://s1/p").db == 0
    assert parse_sentinel_url("REDIS+SENTINEL://[::1]:26380,[fe80::1]/p").hosts == [("::1", 26380), ("fe80::1", 26379)]
    bad_urls = [
        "redis+sentinel://s1:26379", "redis+sentinel://s1/p/x", "redis+sentinel://s1:port/p",
        "redis+sentinel://s1:70000/p", "redis+sentinel://[::1/p", "redis+sentinel://s1/p?ssl_cert_reqs=none",
    ]  # fmt: skip
    for bad in bad_urls:
        with pytest.raises(ValueError):
            parse_sentinel_url(bad)
    assert mask_url("redis+sentinel://u:secret@s1:26379,s2:26379/p") == "redis+sentinel://u:***@s1:26379,s2:26379/p"
    assert mask_url("redis://h:6379/0?password=secret&db=1") == "redis://h:6379/0?password=***&db=1"
    assert load_config(overrides=["redis.url=REDIS://h:6379/0"], env={}).redis.url == "REDIS://h:6379/0"
    with pytest.raises(ConfigError, match="scheme 'http'"):
        load_config(overrides=["redis.url=http://localhost:6379"], env={})
