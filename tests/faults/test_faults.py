"""Faults, for real: a `grpo learner` and two `grpo actor` processes on a real redis-server with an append-only file.
The test SIGKILLs the learner 3 times and actors 5 times, and SIGKILLs and restarts Redis once, while the run goes on.

Then: the run finishes every step; each new learner resumed from a checkpoint (never from step 0) at or after the
last version it had published; every step appears once in metrics.jsonl; each step's groups were counted as trained
exactly once; and produced = trained + dropped + dead + pending + unread holds with nothing unexplained."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from common.config import RedisConfig
from common.procs import wait_until
from common.schemas import LeaseHolder
from common.transport import Transport, read_balance
from ops.redis_server import RedisServer
from tests.faults.runs import LEASE_TTL_S, PATIENT_REDIS, run_settings

pytestmark = [pytest.mark.faults, pytest.mark.slow]

STEPS = 30
BATCH = 4
# (policy version reached, what to kill): 3 learners, 5 actors, Redis once.
EVENTS = [
    (2, "actor"),
    (4, "learner"),
    (7, "actor"),
    (10, "redis"),
    (12, "learner"),
    (15, "actor"),
    (18, "actor"),
    (21, "learner"),
    (24, "actor"),
]


def settings(url: str, model: Path, run_dir: Path) -> list[str]:
    # checkpoint.every=3: a killed learner loses up to 2 steps, whose groups are read and trained again.
    return run_settings(url, model, run_dir, "faults", STEPS, BATCH, *PATIENT_REDIS, "checkpoint.every=3")


def test_kill_learner_actors_and_redis_nothing_lost(demo_model_dir: Path, tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    server = RedisServer(tmp_path / "redis", appendonly=True, fsync="always").start()
    try:
        _run(server, demo_model_dir, tmp_path, processes)
    finally:
        processes.stop_all()
        server.stop()


def _run(server: RedisServer, model: Path, tmp: Path, processes) -> None:  # type: ignore[no-untyped-def]
    run_dir = tmp / "run"
    args = settings(server.url, model, run_dir)
    t = Transport(RedisConfig(url=server.url, retries=30, backoff_max_s=1), "faults")
    logs = tmp / "logs"
    logs.mkdir()
    started = {"learner": 0, "actor": 0}

    def start(role: str) -> subprocess.Popen:
        started[role] += 1
        n = started[role]
        extra = ["-o", f"actor.id=actor-{n}"] if role == "actor" else []
        return processes.grpo(role, *args, *extra, log=logs / f"{role}-{n}.log")

    seen = [-1]

    def version() -> int:
        """The announced version, checked never to go back, whatever is killed."""
        ann = t.latest_weights()
        v = -1 if ann is None else ann.version
        assert v >= seen[-1], f"version went back from {seen[-1]} to {v}"
        seen.append(v)
        return v

    learner = start("learner")
    actors = [start("actor"), start("actor")]
    published_at_kill: list[int] = []
    took_over: list[float] = []
    produced_before_redis = -1
    for at, what in EVENTS:
        ok = wait_until(lambda at=at, p=learner: version() >= at or p.poll() is not None, 240, interval_s=0.1)
        assert ok and learner.poll() is None, _tail(logs)
        if what == "learner":
            learner.kill()
            assert learner.wait() == -signal.SIGKILL, _tail(logs)  # it was alive until killed
            killed_at, lease = t.server_time(), t.lease_holder()
            published_at_kill.append(version())
            learner = start("learner")
            took_over.append(_takeover(t, killed_at, lease, logs / f"learner-{started['learner']}.log"))
        elif what == "actor":
            i = started["actor"] % 2
            actors[i].kill()
            assert actors[i].wait() == -signal.SIGKILL, _tail(logs)  # alive, through the Redis restart too
            actors[i] = start("actor")
        else:
            produced_before_redis = t.stats()["groups_produced"]
            server.kill()
            time.sleep(1.0)  # the processes see the connection drop and start retrying
            server.start()
            assert t.stats()["groups_produced"] >= produced_before_redis  # the append-only file kept it all

    assert learner.wait(timeout=300) == 0, _tail(logs)
    for a in actors:  # they see the run marked done and stop by themselves
        assert a.wait(timeout=60) == 0, _tail(logs)

    # Every step, once, and the last one reached.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert version() >= STEPS and rows[-1]["policy_version"] == version()

    # Each new learner resumed from a checkpoint (never from step 0), and started at a version after every one the
    # killed learner had published (versions only grow: checked at every read above).
    resumed = []
    for n in range(2, started["learner"] + 1):
        text = (logs / f"learner-{n}.log").read_text()
        m = re.search(r"resumed from \S+: step (\d+), policy version (\d+)", text)
        assert m, text
        resumed.append(int(m.group(1)))
        first_row = next(r for r in rows if r["step"] == int(m.group(1)) + 1)
        assert first_row["policy_version"] > published_at_kill[n - 2]
    assert len(resumed) == 3 and all(step > 0 for step in resumed)
    assert "resumed from" not in (logs / "learner-1.log").read_text()

    # Redis went away once: processes logged their bounded reconnect attempts and carried on.
    all_logs = "".join(p.read_text() for p in logs.iterdir())
    assert re.search(r"attempt \d+/31, reconnecting", all_logs)

    b = read_balance(t)
    assert b.unexplained == 0, b.equation()
    assert b.trained == STEPS * BATCH, b.equation()  # a step's groups count once, however often it was retrained
    assert rows[-1]["groups_consumed"] == STEPS * BATCH
    assert b.dead == 0
    print(b.equation(), b.dropped, "| learner resumed at steps", resumed, "| took the run over after (s)", took_over)


def _takeover(t: Transport, killed_at: float, lease: LeaseHolder | None, log: Path) -> float:
    """Seconds from the kill to the new learner taking the run over. One that found the dead one's lease still held
    (it says it waits) must have taken it within the lease's length of the kill (a few polls of slack)."""
    assert lease is not None and lease.ttl_s is not None  # the killed learner held the run
    assert wait_until(lambda: (h := t.lease_holder()) is not None and h.token > lease.token, 120), log.read_text()
    new = t.lease_holder()
    assert new is not None
    if "waiting for run" in log.read_text():
        assert new.since <= killed_at + lease.ttl_s + LEASE_TTL_S / 6 + 1.0, (new, killed_at, lease)
    return round(new.since - killed_at, 1)


def _tail(logs: Path) -> str:
    return "\n".join(f"== {p.name}\n" + p.read_text()[-3000:] for p in sorted(logs.iterdir()))
