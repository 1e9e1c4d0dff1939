"""`grpo status` never calls a run balanced when Redis no longer holds what the run directory shows was trained:
a real Redis, the real CLI, and a run directory with a checkpoint's ``state.json``."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from common.config import RedisConfig
from common.transport import Transport

pytestmark = pytest.mark.integration


def status(url: str, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "common.cli", "status", *extra, "-o", f"redis.url={url}", "-o", "run.name=st",
           "-o", f"run.dir={run_dir}"]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def checkpoint(run_dir: Path, step: int, run_id: str, consumed: int, covers: int = 0) -> None:
    path = run_dir / "checkpoints" / f"step-{step:06d}"
    path.mkdir(parents=True)
    (path / "state.json").write_text(json.dumps({"step": step, "run_id": run_id, "covers": ["0-1"] * covers,
                                                 "counters": {"groups_consumed": consumed}}))  # fmt: skip


def test_status_says_what_redis_no_longer_holds(redis_url: str, tmp_path: Path) -> None:
    t = Transport(RedisConfig(url=redis_url), "st")
    run_dir = tmp_path / "run"
    checkpoint(run_dir, 12, "r1", 48)

    # A Redis that lost everything: the equation balances (0 = 0), and that is not the run's accounting.
    out = status(redis_url, run_dir)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Redis holds nothing of run r1" in out.stdout and "step 12 (48 groups)" in out.stdout
    assert "(balanced)" not in out.stdout and "(balanced since the loss)" in out.stdout

    # Its identity, with counts that match the checkpoint: whole.
    t.create_identity("r1")
    t.client.hset(t.keys.stats, "groups_produced", 48)
    t.client.hset(t.keys.stats, "groups_trained", 48)
    out = status(redis_url, run_dir)
    assert out.returncode == 0 and "(balanced)" in out.stdout and "NOT WHOLE" not in out.stdout, out.stdout

    # A checkpoint just written, its groups not yet acknowledged: Redis counts them once they are, and that is whole.
    checkpoint(run_dir, 14, "r1", 56, covers=8)
    out = status(redis_url, run_dir)
    assert out.returncode == 0 and "(balanced)" in out.stdout and "NOT WHOLE" not in out.stdout, out.stdout

    # Fewer trained groups than the checkpoint shows (restored from an older copy).
    t.client.hset(t.keys.stats, mapping={"groups_produced": 40, "groups_trained": 40})
    out = status(redis_url, run_dir)
    assert out.returncode == 1 and "Redis counts 40 groups trained where" in out.stdout, out.stdout

    # A loss the learner recorded: counted from there on, and said so.
    t.record_reset("r1", 10, 40)
    t.client.hset(t.keys.stats, mapping={"groups_produced": 8, "groups_trained": 8})
    out = status(redis_url, run_dir)
    assert out.returncode == 1, out.stdout
    assert "(learner step 10, 1 time(s)): 40 groups trained before are not in these counts" in out.stdout
    report = json.loads(status(redis_url, run_dir, "--json").stdout)
    assert report["lost"] and "since the loss" in report["equation"]

    # Another run's identity under this name.
    t.client.hset(t.keys.identity, "id", "r2")
    out = status(redis_url, run_dir)
    assert out.returncode == 1 and "Redis holds run r2 under this run.name, not run r1" in out.stdout, out.stdout
    t.close()


def test_status_answers_at_once_when_redis_refuses_commands_for_now(redis_url: str, tmp_path: Path) -> None:
    """A Redis busy with a script answers BUSY to everything else: the services wait that out (redis.full_wait_s,
    600 s), an operator's question does not wait for it, it says so in one line."""
    admin = redis.Redis.from_url(redis_url)
    admin.config_set("lua-time-limit", 100)
    spin = ("local t = redis.call('TIME') while true do local n = redis.call('TIME') "
            "if (n[1] - t[1]) * 1000000 + n[2] - t[2] > tonumber(ARGV[1]) then return 1 end end")  # fmt: skip
    busy = redis.Redis.from_url(redis_url, socket_timeout=60)

    def run() -> None:
        with contextlib.suppress(redis.ResponseError):  # "Script killed by user": the test's SCRIPT KILL
            busy.eval(spin, 0, 20_000_000)

    spinning = threading.Thread(target=run, daemon=True)
    spinning.start()
    try:
        time.sleep(0.5)  # past lua-time-limit: Redis is BUSY
        t0 = time.monotonic()
        out = status(redis_url, tmp_path / "run")
        took = time.monotonic() - t0
        assert out.returncode != 0 and "busy" in out.stderr.lower(), out.stdout + out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert took < 15, took  # not the 600 s a service waits (the spin lasts 20 s)
    finally:
        admin.script_kill()
        spinning.join(30)
        busy.close()
        admin.close()
