"""A full Redis, for real: a `grpo learner` and two `grpo actor` processes on a redis-server that the test fills
mid-run, while the learner is inside a step, with the default `redis.*` settings. `maxmemory` is set just below the
memory Redis uses, with `maxmemory-policy noeviction`, so that Redis refuses every command that may grow its memory
(OOM: the actors' rounds, the prompt cursor, heartbeats, and any command queued in a transaction, such as the learner's
reading of the counters for its metrics row) for 40 s; then the limit is lifted.

Then: no process died during the 40 s or after; each said in its log that Redis was full, and none wrote a traceback;
the run finishes every step (each once in metrics.jsonl), the learner and both actors exit 0, and the accounting
equation balances with nothing unexplained."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from common.children import wait_until
from common.config import RedisConfig
from common.metrics import gather_endpoints
from common.transport import Transport, read_balance
from ops.redis_server import RedisServer
from tests.faults.runs import run_settings
from tests.faults.test_faults import _tail

pytestmark = [pytest.mark.faults, pytest.mark.slow]

STEPS = 10
BATCH = 4
FULL_AT = 3  # the policy version reached when Redis fills up
# Each learner step lasts at least this long, and Redis fills while the learner is inside one: the step's end (its
# version announced, its row's counters read) then meets the full Redis. Filled while the learner idles, waiting for
# groups the blocked actors cannot send, the learner met no refusal in 40 s and had nothing to say.
STEP_S = 2.0
FULL_S = 40.0
FULL_LINE = "Redis is full"  # what a process says while it waits for room in Redis
PROBE = "probe:full"  # the test's own write, which must be refused while Redis is full
# How far below the memory Redis uses maxmemory is set: more than the run can free while full (the learner deletes
# the groups it trained, about 5 KB each, and closed connections free theirs), so that writes stay refused between
# two probes. With 32 KiB a fast machine freed that within one probe's 0.25 s, and the run got its writes through and
# finished its ten steps in the first second of the 40.
MARGIN = 4 * 1024 * 1024


def test_redis_full_for_40s_mid_run_kills_nothing(demo_model_dir: Path, tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    server = RedisServer(tmp_path / "redis").start()
    try:
        _run(server, demo_model_dir, tmp_path, processes)
    finally:
        processes.stop_all()
        server.stop()


def _run(server: RedisServer, model: Path, tmp: Path, processes) -> None:  # type: ignore[no-untyped-def]
    run_dir = tmp / "run"
    args = run_settings(server.url, model, run_dir, "full", STEPS, BATCH, "checkpoint.every=3",
                        f"learner.min_step_s={STEP_S}")  # fmt: skip
    t = Transport(RedisConfig(url=server.url), "full")
    admin = redis.Redis.from_url(server.url)
    logs = tmp / "logs"
    logs.mkdir()
    learner = processes.grpo("learner", *args, log=logs / "learner.log")
    actors = [processes.grpo("actor", *args, "-o", f"actor.id=a{i}", log=logs / f"actor-{i}.log") for i in (1, 2)]
    everyone: list[subprocess.Popen] = [learner, *actors]

    def alive() -> bool:
        return all(p.poll() is None for p in everyone)

    def version() -> int:
        ann = t.latest_weights()
        return -1 if ann is None else ann.version

    def training() -> bool:  # the learner is inside a step (its /healthz says what its loop is doing)
        return doing(run_dir).startswith("training step") and version() >= FULL_AT

    assert wait_until(lambda: training() or not alive(), 240, interval_s=0.1) and alive(), _tail(logs)
    produced_before = t.counters().produced
    refused, produced_while_full = _hold_full(admin, t, FULL_S, alive)
    assert alive(), _tail(logs)  # every process rode the 40 s out (checked 4 times a second)
    print(f"refused {refused:.0%} of the probes; groups produced while full: {produced_while_full - produced_before}")
    assert refused >= 0.9, refused  # Redis was full (the test's own writes were refused) for the whole 40 s

    assert learner.wait(timeout=300) == 0, _tail(logs)
    for a in actors:  # they see the run marked done and stop by themselves
        assert a.wait(timeout=60) == 0, _tail(logs)

    text = {p.name: p.read_text() for p in logs.iterdir()}
    assert not any("Traceback" in v for v in text.values()), _tail(logs)
    for name in ("learner.log", "actor-1.log", "actor-2.log"):  # each met the full Redis, and said so
        assert FULL_LINE in text[name], _tail(logs)

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    b = read_balance(t)
    print(b.equation(), b.dropped)
    assert b.unexplained == 0, b.equation()
    assert b.trained == STEPS * BATCH, b.equation()
    admin.close()
    t.close()


def doing(run_dir: Path) -> str:
    """What the learner's loop says it is doing ('' before its metrics server is up)."""
    learners = [e for e in gather_endpoints(run_dir) if e["role"] == "learner"]
    if not learners:
        return ""
    url = str(learners[0]["metrics_url"]).replace("/metrics", "/healthz")
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return str(json.loads(r.read()).get("doing", ""))
    except (OSError, ValueError):
        return ""


def _hold_full(admin: redis.Redis, t: Transport, seconds: float, alive: Callable[[], bool]) -> tuple[float, int]:
    """Keep Redis refusing writes for ``seconds``: ``maxmemory`` just below the memory it uses (noeviction), set
    lower again whenever the test's own write gets through (the learner's XDELs and closed connections free some).
    Returns the share of the test's writes that were refused, and the groups produced when it ends (at once when a
    process died)."""
    admin.config_set("maxmemory-policy", "noeviction")
    probes = refused = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end and alive():
            probes += 1
            try:
                admin.set(PROBE, "x")
            except redis.exceptions.OutOfMemoryError:
                refused += 1
            else:  # not full (yet, or no longer): below what it uses now
                admin.delete(PROBE)
                used = int(admin.info("memory")["used_memory"])
                admin.config_set("maxmemory", max(1, used - MARGIN))
            time.sleep(0.25)
        return refused / probes, t.counters().produced
    finally:
        admin.config_set("maxmemory", 0)
