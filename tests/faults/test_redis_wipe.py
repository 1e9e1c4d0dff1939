"""Redis wiped mid-run, for real: a `grpo learner` and two `grpo actor` processes on a redis-server without
persistence. The test flushes Redis (FLUSHALL) while they train, then SIGKILLs the learner and restarts Redis empty (a
restart without persistence, or a failover to an empty replica) before starting a new learner.

Then: the learner never dies of it (no traceback, no exit 1) and says so in one line each time; announced versions
never go back (an actor never holds a version above the announced one, so no group is dropped as from the future);
the run finishes every step; the groups Redis counts as trained plus those the learner recorded as trained before
the loss are exactly the groups trained; the equation balances; and `grpo status` says the counts are not the whole
run's, with exit 1, instead of "balanced"."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.children import wait_until
from common.config import RedisConfig
from common.transport import Transport, read_balance
from ops.redis_server import RedisServer
from tests.faults.runs import PATIENT_REDIS, run_settings
from tests.faults.test_faults import _tail

pytestmark = [pytest.mark.faults, pytest.mark.slow]

STEPS = 14
BATCH = 4
LOST = "Redis lost this run's state"


def settings(url: str, model: Path, run_dir: Path) -> list[str]:
    return run_settings(url, model, run_dir, "wipe", STEPS, BATCH, *PATIENT_REDIS, "checkpoint.every=3")


def test_redis_wiped_mid_run_and_restarted_empty(demo_model_dir: Path, tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    server = RedisServer(tmp_path / "redis").start()  # no append-only file: a restart loses everything
    try:
        _run(server, demo_model_dir, tmp_path, processes)
    finally:
        processes.stop_all()
        server.stop()


def _run(server: RedisServer, model: Path, tmp: Path, processes) -> None:  # type: ignore[no-untyped-def]
    run_dir = tmp / "run"
    args = settings(server.url, model, run_dir)
    t = Transport(RedisConfig(url=server.url, retries=30, backoff_max_s=1), "wipe")
    logs = tmp / "logs"
    logs.mkdir()
    seen = [-1]

    def version() -> int:
        """The announced version (none while Redis is empty), checked never to go back."""
        ann = t.latest_weights()
        if ann is None:
            return seen[-1]
        assert ann.version >= seen[-1], f"version went back from {seen[-1]} to {ann.version}"
        seen.append(ann.version)
        return ann.version

    def reach(v: int, learner: subprocess.Popen) -> None:
        ok = wait_until(lambda: version() >= v or learner.poll() is not None, 240, interval_s=0.1)
        assert ok and learner.poll() is None, _tail(logs)

    learner = processes.grpo("learner", *args, log=logs / "learner-1.log")
    actors = [processes.grpo("actor", *args, "-o", f"actor.id=a{i}", log=logs / f"actor-{i}.log") for i in (1, 2)]

    reach(4, learner)
    t.client.flushall()  # everything: stream, counters, announcement, identity
    reach(8, learner)  # trained on after it, on a stream it recreated
    assert LOST in (logs / "learner-1.log").read_text()

    learner.kill()
    assert learner.wait() == -signal.SIGKILL, _tail(logs)  # it was alive until killed: the flush did not stop it
    at_kill = version()
    server.kill()  # and Redis restarts empty
    server.start()
    learner = processes.grpo("learner", *args, log=logs / "learner-2.log")
    assert learner.wait(timeout=300) == 0, _tail(logs)
    for a in actors:
        assert a.wait(timeout=60) == 0, _tail(logs)

    text = {p.name: p.read_text() for p in logs.iterdir()}
    assert not any("Traceback" in v for v in text.values()), _tail(logs)
    assert text["learner-1.log"].count(LOST) == 1 and text["learner-2.log"].count(LOST) == 1, _tail(logs)
    m = re.search(r"continuing at version (\d+)", text["learner-2.log"])
    resumed = re.search(r"resumed from \S+: step \d+, policy version (\d+)", text["learner-2.log"])
    assert resumed, text["learner-2.log"]
    # Above every version the actors could hold; killed right after the checkpoint of its last published version,
    # the learner resumes at that very version (the same weights) and has nothing to continue past.
    continued = m is not None and int(m.group(1)) > at_kill
    assert continued or (m is None and int(resumed.group(1)) == at_kill), (at_kill, text["learner-2.log"])

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    b = read_balance(t)
    identity = t.identity()
    print(b.equation(), b.dropped, identity)
    assert identity is not None
    assert b.unexplained == 0, b.equation()
    assert "future" not in b.dropped, b.dropped  # actors followed the new versions: none ran ahead of the learner
    # Every trained group is counted once: in Redis since the loss, or in what the learner recorded before it.
    assert identity.trained_before_reset + b.trained == rows[-1]["groups_consumed"], (identity, b)
    assert identity.resets == 1  # the restart lost the flush's record too; the second learner wrote this one

    status = subprocess.run(
        [sys.executable, "-m", "common.cli", "status", *args], capture_output=True, text=True, timeout=120
    )
    print(status.stdout)
    assert status.returncode == 1, status.stdout + status.stderr
    assert LOST in status.stdout and "(balanced)" not in status.stdout
    assert f"{identity.trained_before_reset} groups trained before are not in these counts" in status.stdout
    t.close()
