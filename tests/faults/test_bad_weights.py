"""Garbage in ``weights:latest``, for real: a `grpo learner` and two `grpo actor` processes on a real redis-server.
While they train, the test SIGSTOPs the learner (so that nothing overwrites what it writes), changes the announcement
with one command each (a digest of an unknown algorithm, the ``uri`` deleted, a version that is not a number, a
format of a newer build) and wakes the actors on the weights channel; `grpo status` reads each one. Then it
SIGKILLs the learner, leaves garbage behind, and starts a new learner on it.

Then: no process dies of it (no traceback; actors and learners exit 0 at the end); each actor ignores each bad value,
says so once and counts it; `grpo status` reports it in one line instead of a traceback; the new learner starts,
and its announcement replaces the garbage; the run finishes every step and the equation balances."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from common.children import wait_until
from common.config import RedisConfig
from common.schemas import SchemaError
from common.transport import Transport, read_balance
from tests.faults.runs import run_settings
from tests.faults.test_faults import _tail

pytestmark = [pytest.mark.faults, pytest.mark.slow]

STEPS = 12
BATCH = 4
IGNORED = "ignoring weights:latest"

# One command each, on the hash the learner announced.
GARBAGE = [
    ("hset", "digest", "blake3:" + "a" * 32),  # a digest name this build does not know
    ("hdel", "uri", ""),  # the uri gone
    ("hset", "version", "seven"),  # a version that is not a number
    ("hset", "format", "hf-safetensors-v9"),  # a newer build's format
]


def settings(url: str, model: Path, run_dir: Path) -> list[str]:
    return run_settings(url, model, run_dir, "badw", STEPS, BATCH, "checkpoint.every=3")


def test_garbage_in_weights_latest_is_survived(demo_model_dir: Path, redis_url: str, tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    run_dir = tmp_path / "run"
    args = settings(redis_url, demo_model_dir, run_dir)
    t = Transport(RedisConfig(url=redis_url), "badw")
    logs = tmp_path / "logs"
    logs.mkdir()
    learner = processes.grpo("learner", *args, log=logs / "learner-1.log")
    actors = [processes.grpo("actor", *args, "-o", f"actor.id=actor-{i}", log=logs / f"actor-{i}.log") for i in (1, 2)]

    def version() -> int:
        try:
            ann = t.latest_weights()
        except SchemaError:
            return -1
        return -1 if ann is None else ann.version

    def malformed_seen(actor: int) -> float:
        endpoint = json.loads((run_dir / "endpoints.d" / f"actor-actor-{actor}.json").read_text())
        text = urllib.request.urlopen(endpoint["metrics_url"], timeout=5).read().decode()
        m = re.search(r"^grpo_actor_weight_announcements_malformed_total (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def status() -> subprocess.CompletedProcess:  # type: ignore[type-arg]
        return subprocess.run([sys.executable, "-m", "common.cli", "status", *args], capture_output=True, text=True,
                              timeout=120)  # fmt: skip

    assert wait_until(lambda: version() >= 2 or learner.poll() is not None, 300), _tail(logs)
    for n, (command, field, value) in enumerate(GARBAGE, start=1):
        learner.send_signal(signal.SIGSTOP)  # nothing overwrites the garbage while the actors read it
        try:
            before = version()
            if command == "hset":
                t.client.hset(t.keys.weights_latest, field, value)
            else:
                t.client.hdel(t.keys.weights_latest, field)
            t.client.publish(t.keys.weights_channel, "garbage")  # wakes actors waiting for room, as a writer would
            assert wait_until(lambda n=n: all(malformed_seen(a) >= n for a in (1, 2)), 120), _tail(logs)
            shown = status()
            assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stdout + shown.stderr
            assert "weights:latest is malformed" in shown.stdout and "published version none yet" in shown.stdout
            assert all(a.poll() is None for a in actors), _tail(logs)
        finally:
            learner.send_signal(signal.SIGCONT)
        # The learner's next announcement replaces the garbage, and actors load it.
        assert wait_until(lambda b=before: version() > b or learner.poll() is not None, 300), _tail(logs)
        assert learner.poll() is None, _tail(logs)

    # A learner that starts on garbage: it says so, and its first announcement replaces it.
    learner.kill()
    assert learner.wait() == -signal.SIGKILL
    t.client.hset(t.keys.weights_latest, "version", "v-after-the-crash")
    learner = processes.grpo("learner", *args, log=logs / "learner-2.log")
    assert learner.wait(timeout=600) == 0, _tail(logs)
    for a in actors:  # they see the run marked done and stop by themselves
        assert a.wait(timeout=120) == 0, _tail(logs)

    second = (logs / "learner-2.log").read_text()
    assert IGNORED in second and "resumed from" in second
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert version() == rows[-1]["policy_version"]
    for i in (1, 2):  # said once per distinct value, never a traceback
        said = [line.split(IGNORED, 1)[1] for line in (logs / f"actor-{i}.log").read_text().splitlines()
                if IGNORED in line]  # fmt: skip
        assert len(said) >= len(GARBAGE) and len(said) == len(set(said)), said
    assert "Traceback" not in "".join(p.read_text() for p in logs.iterdir())
    b = read_balance(t)
    assert b.unexplained == 0, b.equation()
    assert b.trained == STEPS * BATCH, b.equation()
