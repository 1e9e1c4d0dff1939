"""A run's keys all live in one Redis Cluster slot: the real `grpo run` against a cluster-enabled redis-server (one
node owning every slot), where any script or transaction that touched two slots would fail (CROSSSLOT), and then
the server itself says which slot each key is in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from common.children import wait_until
from common.config import RedisConfig
from common.transport import Transport
from ops.redis_server import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RUN = "cluster-run"


@pytest.fixture
def cluster_node(tmp_path: Path):  # type: ignore[no-untyped-def]
    server = RedisServer(
        tmp_path / "redis", extra_args=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
    ).start()
    try:
        client = redis.Redis.from_url(server.url)
        client.execute_command("CLUSTER", "ADDSLOTS", *range(16384))
        # The node settles its state on its next cluster tick.
        assert wait_until(lambda: b"cluster_state:ok" in client.execute_command("CLUSTER", "INFO"), 10)
        with pytest.raises(redis.ResponseError, match="same slot"):  # the node refuses two slots in one script
            client.eval("return 1", 2, "grpo:{one}:x", "grpo:{other}:x")
        client.close()
        yield server
    finally:
        server.stop()


def test_every_key_of_a_run_is_in_one_cluster_slot(
    cluster_node, demo_model_dir: Path, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    run_dir = tmp_path / "run"
    log = tmp_path / "grpo-run.log"
    proc = processes.grpo(
        "run", "--plain",
        "-o", f"redis.url={cluster_node.url}", "-o", f"run.name={RUN}", "-o", f"run.dir={run_dir}",
        "-o", "run.steps=6", "-o", "learner.batch_groups=8", "-o", "actor.prompts_per_round=8",
        log=log,
    )  # fmt: skip
    assert proc.wait(timeout=300) == 0, log.read_text()
    assert json.loads((run_dir / "summary.json").read_text())["unexplained"] == 0

    # The scripts a run did not need: a dead letter, its replay, a drop.
    t = Transport(RedisConfig(url=cluster_node.url), RUN)
    try:
        t.produce([b"not msgpack", b"also not"])
        entries = t.read("test", 2, 1000)
        t.dead_letter(entries[0], "test")
        assert t.replay_dead(t.dead_letters(1)[0].id) is not None
        t.drop([entries[1].id], "test")
        t.heartbeat("extra-actor", 30, {})

        keys = [k.decode() for k in t.client.keys("*")]
        assert {t.keys.groups, t.keys.dead, t.keys.stats, t.keys.weights_latest, t.keys.trained_ids} <= set(keys)
        assert all(k.startswith(f"grpo:{{{RUN}}}:") for k in keys), keys
        slots = {k: t.client.execute_command("CLUSTER", "KEYSLOT", k) for k in [*keys, t.keys.weights_channel]}
        assert len(set(slots.values())) == 1, slots
    finally:
        t.close()
