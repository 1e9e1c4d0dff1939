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
import sys
import time
from pathlib import Path

import pytest

from common.children import wait_until
from common.config import RedisConfig
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
    actor_ids = ["actor-1", "actor-2"]
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
            # Killed while it holds a round's claim, so that its positions must be given back: an actor waiting for
            # room in the stream holds none, and on a slow machine that wait can be where it spends most of its time.
            wait_until(lambda i=i: _holds_claim(t, actor_ids[i]), 60, interval_s=0.02)
            actors[i].kill()
            assert actors[i].wait() == -signal.SIGKILL, _tail(logs)  # alive, through the Redis restart too
            actors[i] = start("actor")
            actor_ids[i] = f"actor-{started['actor']}"
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

    # Every prompt position drawn is accounted for: sent (the groups above), filtered, discarded, skipped, held by a
    # round, or waiting to be drawn again; the killed actors' positions were given back and drawn again, and no
    # position was trained twice (each trained group's position marked once, as the learner acknowledged it).
    pb = t.prompt_balance()
    assert pb.unexplained == 0, pb.equation()
    assert pb.counters.sent == b.produced, (pb.equation(), b.equation())
    assert pb.counters.requeued.get("lost", 0) > 0 and pb.counters.redrawn > 0, pb.counters
    assert pb.counters.trained == b.trained and pb.counters.retrained == 0, pb.counters
    status = subprocess.run([sys.executable, "-m", "common.cli", "status", *args], capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert status.returncode == 0 and "prompts drawn" in status.stdout, status.stdout + status.stderr
    assert status.stdout.count("(balanced)") == 2, status.stdout
    print(b.equation(), b.dropped, "| learner resumed at steps", resumed, "| took the run over after (s)", took_over)
    print(pb.equation(), "| given back", pb.counters.requeued, "drawn again", pb.counters.redrawn)


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


def _holds_claim(t: Transport, actor_id: str) -> bool:
    """Whether a round of ``actor_id`` (holder ``<id>`` or ``<id>/<slot>``) holds prompt positions now."""
    return any(h == actor_id or h.startswith(actor_id + "/") for h in t.prompt_balance().claims)


def _tail(logs: Path) -> str:
    return "\n".join(f"== {p.name}\n" + p.read_text()[-3000:] for p in sorted(logs.iterdir()))
