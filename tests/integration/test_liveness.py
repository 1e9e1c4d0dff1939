"""Liveness of real `grpo learner` and `grpo actor` processes on a real Redis, over real HTTP: a wait longer than
``metrics.stall_after_s`` that beats as it goes (groups from slow actors, room in the stream) keeps ``/healthz`` at
200, and a loop thread hung in a grader call (the process alive, its other threads going on) turns it 503 within
the bound, saying what the loop was doing and where it hangs.

The hang: ``tests.graders_for_tests:hang_while_file`` graded inline (in the loop's thread) never returns while the
test's file exists. Each process is then stopped by its PID, as the liveness probe's restart would."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from common.children import wait_until
from common.config import RedisConfig
from common.metrics import gather_endpoints
from common.transport import Transport
from tests.conftest import pid_alive
from tests.integration.test_actor_flow import sim_actor
from tests.integration.test_learner_process import group

pytestmark = pytest.mark.integration

HANG = "grader.name=tests.graders_for_tests:hang_while_file"
POLL_S = 0.25


def probe(url: str) -> tuple[int, dict[str, Any]]:
    """What a liveness probe sees: the status and the JSON body."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def health_url(run_dir: Path, log: Path) -> str:
    assert wait_until(lambda: bool(gather_endpoints(run_dir)), 180), log.read_text()
    return str(gather_endpoints(run_dir)[0]["metrics_url"]).replace("/metrics", "/healthz")


def healthy_while(url: str, doing: str, seconds: float) -> list[dict[str, Any]]:
    """Probe for ``seconds``: every answer 200 and ``doing``; returns them."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        status, info = probe(url)
        assert status == 200 and info["ok"] and info["doing"] == doing, info
        seen.append(info)
        time.sleep(POLL_S)
    return seen


def first_failure(url: str, timeout_s: float) -> tuple[float, list[dict[str, Any]], dict[str, Any]]:
    """Probe until /healthz fails: when (time.monotonic()), the 200 answers before it, and the failing body."""
    before: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, info = probe(url)
        if status == 503:
            return time.monotonic(), before, info
        assert status == 200, (status, info)
        before.append(info)
        time.sleep(POLL_S)
    raise AssertionError(f"/healthz still answers 200 after {timeout_s:.0f}s: {before[-1:]}")


def kill_by_pid(proc: Any) -> None:
    """A hung loop does not stop on SIGTERM (its stop flag is never read): SIGKILL, as a supervisor ends it."""
    assert proc.poll() is None and pid_alive(proc.pid)  # the process lived on through the hang
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_a_learner_whose_loop_hangs_fails_healthz_within_its_bound(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes: Any
) -> None:
    from transformers import AutoTokenizer

    bound = 20.0  # longer than any step of this tiny run (loading the model, an evaluation) on a loaded machine
    hang = tmp_path / "hang"
    run_dir, log = tmp_path / "run", tmp_path / "learner.log"
    settings = [
        f"redis.url={redis_url}", f"model.path={tiny_model_dir}", f"run.dir={run_dir}", "run.name=live",
        "run.steps=50", "learner.batch_groups=1", "sampling.group_size=4", "learner.max_staleness=50",
        "task.eval_size=2", "learner.eval_every=1", "grader.isolation=inline", HANG,
        "run.lease_ttl_s=5", f"metrics.stall_after_s={bound:g}",
    ]  # fmt: skip
    proc = processes.grpo("learner", *[a for o in settings for a in ("-o", o)], log=log,
                          env={"GRPO_TEST_HANG_FILE": str(hang)})  # fmt: skip
    url = health_url(run_dir, log)
    assert wait_until(lambda: probe(url)[1].get("doing") == "waiting for groups", 180), (probe(url), log.read_text())

    # No actor yet: the learner waits for groups longer than the bound, beating at each read; alive and ready.
    seen = healthy_while(url, "waiting for groups", bound + 5)
    assert seen[-1]["for_s"] > bound and seen[-1]["quiet_s"] < 5 and seen[-1]["stall_after_s"] == bound
    assert seen[-1]["role"] == "learner" and seen[-1]["step"] == 0
    assert probe(url.replace("/healthz", "/readyz"))[0] == 200

    # Groups arrive: steps 1 and 2 train and evaluate.
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    t = Transport(RedisConfig(url=redis_url), "live")
    t.produce([group(tok, 0), group(tok, 0)])
    assert wait_until(lambda: probe(url)[1].get("step") == 2 and probe(url)[1]["doing"] == "waiting for groups", 120)

    # The grader hangs from now on: the next step's evaluation never returns; its loop thread alone is stuck.
    hang.touch()
    t.produce([group(tok, 0)])
    sent = time.monotonic()
    failed_at, before, info = first_failure(url, bound + 60)
    assert any(b["doing"] == "evaluating" for b in before), before  # 200 while within the bound
    assert info["doing"] == "evaluating" and info["step"] == 3 and not info["ok"] and not info["ready"]
    assert bound <= info["quiet_s"] <= bound + 2 and info["stall_after_s"] == bound
    assert failed_at - sent <= bound + 10  # the step before the evaluation, then the bound: no later
    assert "graders_for_tests.py" in info["stuck_at"] and "hang_while_file" in info["stuck_at"], info
    assert probe(url.replace("/healthz", "/readyz"))[0] == 503
    assert wait_until(lambda: "has not moved for" in log.read_text(), 10)
    assert "hang_while_file" in log.read_text()  # the log has the loop thread's stack
    # Hung for longer than four lease TTLs, the learner still holds its lease: the renewing thread goes on, so the
    # lease cannot tell a hung loop (nor can a successor take the run over until the process is restarted).
    assert t.client.exists(t.keys.lease)
    kill_by_pid(proc)


def test_an_actor_whose_loop_hangs_fails_healthz_within_its_bound(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes: Any
) -> None:
    bound = 15.0
    hang = tmp_path / "hang"
    log = tmp_path / "actor.log"
    # Rounds of 2 groups, at most 4 unread and no learner: two rounds, then it waits for room.
    args = sim_actor(tiny_model_dir, tmp_path, redis_url, "actor.max_stream_groups=4", "actor.prompts_per_round=2",
                     "actor.sim_tokens_per_s=4000", HANG, f"metrics.stall_after_s={bound:g}")  # fmt: skip
    proc = processes.grpo(*args, log=log, env={"GRPO_TEST_HANG_FILE": str(hang)})
    url = health_url(tmp_path, log)
    assert wait_until(lambda: probe(url)[1].get("doing") == "waiting for room", 180), (probe(url), log.read_text())
    # Backpressure longer than the bound: alive, beating as it waits.
    seen = healthy_while(url, "waiting for room", bound + 5)
    assert seen[-1]["for_s"] > bound and seen[-1]["role"] == "actor" and seen[-1]["id"] == "actor-it"

    # Room again, and the grader hangs: the round's grading never returns.
    hang.touch()
    t = Transport(RedisConfig(url=redis_url), "it")
    t.client.xtrim(t.keys.groups, maxlen=0)
    freed = time.monotonic()
    failed_at, before, info = first_failure(url, bound + 60)
    assert any(b["doing"] == "grading" for b in before), before
    assert info["doing"] == "grading" and bound <= info["quiet_s"] <= bound + 2 and failed_at - freed <= bound + 10
    assert "hang_while_file" in info["stuck_at"], info
    # Its heartbeat thread keeps its key in Redis alive: only /healthz tells that the loop is stuck.
    assert "actor-it" in t.live_actors()
    kill_by_pid(proc)
