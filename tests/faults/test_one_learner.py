"""One learner per run, for real: `grpo learner` processes and a `grpo actor` on a real redis-server.

A second learner started on a live run exits 4 (``learner.if_held=exit``) or waits (``wait``), writing nothing of the
run either way, and the first finishes with the accounting balanced. A learner frozen (SIGSTOP) past its lease while
a second one takes the run over wakes up, has every write refused, exits 5, and leaves nothing that the resume path
or a pruner would use; the run finishes with nothing unexplained and versions that never go back."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import pytest

from common.config import RedisConfig
from common.procs import wait_until
from common.transport import Transport, read_balance
from common.weights import version_token
from learner import fencing
from tests.faults.runs import run_settings

pytestmark = [pytest.mark.faults, pytest.mark.slow]

BATCH = 2


def files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and modification time: what a learner that writes nothing leaves."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def keys(t: Transport) -> dict[bytes, bytes | None]:
    """Every key of the run, dumped, but the lease and the actors' heartbeats (keys with a TTL, which move with time
    alone: the holder renews one, and a frozen actor's expires)."""
    return {
        k: t.client.dump(k) for k in sorted(t.client.keys("*")) if b":actors:" not in k and b":learner:lease" not in k
    }


class Versions:
    """The announced version, read every 50 ms from a thread: it must never go back."""

    def __init__(self, t: Transport):
        self.t, self.seen, self.stop = t, [-1], threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.stop.wait(0.05):
            ann = self.t.latest_weights()
            if ann is not None:
                self.seen.append(ann.version)

    def now(self) -> int:
        return self.seen[-1]

    def close(self) -> list[int]:
        self.stop.set()
        self.thread.join()
        return self.seen


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_second_learner_on_a_live_run_never_trains(demo_model_dir: Path, redis_url: str, tmp_path: Path,
                                                      processes) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    steps = 10
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    args = run_settings(redis_url, demo_model_dir, run_dir, "one", steps, BATCH, "checkpoint.every=2",
                        "run.lease_ttl_s=60", "learner.min_step_s=1.5")  # fmt: skip
    t = Transport(RedisConfig(url=redis_url), "one")
    first = processes.grpo("learner", *args, log=logs / "first.log")
    actor = processes.grpo("actor", *args, log=logs / "actor.log")
    assert wait_until(lambda: (a := t.latest_weights()) is not None and a.version >= 2, 240), _tail(logs)

    # The first learner and the actor frozen for a moment, so that only the second learner could change anything: it
    # exits 4, in one line naming the holder, and the run (its directory, every key in Redis) is as it was.
    for p in (first, actor):
        p.send_signal(signal.SIGSTOP)
    try:
        before, redis_before = files(run_dir), keys(t)
        second = processes.grpo("learner", *args, "-o", "learner.if_held=exit", log=logs / "second.log")
        assert second.wait(timeout=120) == 4, _tail(logs)
        assert files(run_dir) == before and keys(t) == redis_before
        # A third learner starts while the run is still far from done (its start-up must not outlast the first's
        # steps, or it would find the run finished and never wait).
        third = processes.grpo("learner", *args, log=logs / "third.log")
    finally:
        for p in (first, actor):
            p.send_signal(signal.SIGCONT)
    line = (logs / "second.log").read_text().strip().splitlines()[-1]
    assert line.startswith("grpo learner: run one is held by ") and f"pid {first.pid} (lease token 1)" in line, line

    # The third waits, saying for whom, and writes nothing while it does; the first trains to its last step.
    assert wait_until(lambda: "waiting for run one: held by" in (logs / "third.log").read_text(), 120), _tail(logs)
    assert f"pid {first.pid}" in (logs / "third.log").read_text()
    for p in (first, actor):  # and while it waits, it writes nothing either
        p.send_signal(signal.SIGSTOP)
    try:
        before, redis_before = files(run_dir), keys(t)
        assert not wait_until(lambda: third.poll() is not None, 3)
        assert files(run_dir) == before and keys(t) == redis_before
    finally:
        for p in (first, actor):
            p.send_signal(signal.SIGCONT)
    assert first.wait(timeout=300) == 0, _tail(logs)
    # The first gave the run up as it finished: the third takes it at once, finds every step trained, and ends.
    assert third.wait(timeout=120) == 0, _tail(logs)
    assert "has trained its 10 steps already" in (logs / "third.log").read_text()
    assert actor.wait(timeout=60) == 0, _tail(logs)

    assert [r["step"] for r in rows(run_dir)] == list(range(steps + 1))  # every step once: the first's alone
    b = read_balance(t)
    assert b.unexplained == 0 and b.trained == steps * BATCH, b.equation()


def test_a_learner_frozen_past_its_lease_is_fenced_when_it_wakes(demo_model_dir: Path, redis_url: str,
                                                                  tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    steps, ttl = 16, 3
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    args = run_settings(redis_url, demo_model_dir, run_dir, "frozen", steps, BATCH, "checkpoint.every=2",
                        f"run.lease_ttl_s={ttl}")  # fmt: skip
    t = Transport(RedisConfig(url=redis_url), "frozen")
    versions = Versions(t)
    try:
        first = processes.grpo("learner", *args, log=logs / "first.log")
        actor = processes.grpo("actor", *args, log=logs / "actor.log")
        assert wait_until(lambda: versions.now() >= 5, 240), _tail(logs)
        first.send_signal(signal.SIGSTOP)  # frozen mid-run: its lease runs out, its pending groups stay its own
        second = processes.grpo("learner", *args, log=logs / "second.log")
        assert wait_until(lambda: (h := t.lease_holder()) is not None and h.token == 2, 120), _tail(logs)
        took_at = versions.now()
        assert wait_until(lambda: versions.now() >= took_at + 4, 240), _tail(logs)  # the second trains on
        first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=60) == 5, _tail(logs)
        assert second.wait(timeout=300) == 0, _tail(logs)
        assert actor.wait(timeout=60) == 0, _tail(logs)
    finally:
        seen = versions.close()
    assert seen == sorted(seen), "a version went back"

    out = (logs / "first.log").read_text()
    assert "grpo learner: stopped: this learner no longer holds the run" in out, out[-3000:]
    # Nothing the first wrote after the second took over is used: no checkpoint or version of its token counts.
    ckpts = run_dir / "checkpoints"
    superseded_step, superseded_version = fencing.superseded_steps(ckpts), fencing.superseded_versions(ckpts)
    for path in ckpts.glob("step-*"):
        token = json.loads((path / "state.json").read_text())["lease_token"]
        assert token == 2 or not superseded_step(token, int(path.name[5:])), path
    for path in (run_dir / "weights").glob("v*"):
        assert not superseded_version(version_token(path), int(path.name[1:])), path
    assert json.loads((ckpts / f"step-{steps:06d}" / "state.json").read_text())["lease_token"] == 2

    b = read_balance(t)
    assert b.unexplained == 0 and b.trained == steps * BATCH, b.equation()
    assert rows(run_dir)[-1]["step"] == steps


def test_steps_longer_than_the_lease_keep_it(demo_model_dir: Path, redis_url: str, tmp_path: Path,
                                             processes) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """A thread renews the lease every third of run.lease_ttl_s: steps of 3 s under a lease of 1 s never lose it."""
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    args = run_settings(redis_url, demo_model_dir, run_dir, "long", 3, BATCH, "run.lease_ttl_s=1",
                        "learner.min_step_s=3")  # fmt: skip
    t = Transport(RedisConfig(url=redis_url), "long")
    learner = processes.grpo("learner", *args, log=logs / "learner.log")
    actor = processes.grpo("actor", *args, log=logs / "actor.log")
    assert learner.wait(timeout=240) == 0, _tail(logs)
    assert actor.wait(timeout=60) == 0, _tail(logs)
    out = (logs / "learner.log").read_text()
    assert "holding run long with lease token 1" in out and "had lapsed" not in out, out[-3000:]
    assert t.lease_holder() is None  # given up at the end: a next learner need not wait
    assert rows(run_dir)[-1]["step"] == 3


def _tail(logs: Path) -> str:
    return "\n".join(f"== {p.name}\n" + p.read_text()[-3000:] for p in sorted(logs.iterdir()))
