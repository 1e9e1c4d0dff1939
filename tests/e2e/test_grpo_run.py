"""The real `grpo run` command: learner and actors as processes through a private Redis, end to end."""

from __future__ import annotations

import json
import re
import shlex
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from common.children import wait_until
from tests.conftest import pid_alive

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SHORT = [
    "-o", "run.steps=20",
    "-o", "learner.batch_groups=8",
    "-o", "learner.eval_every=10",
    "-o", "actor.prompts_per_round=8",
]  # fmt: skip


def redis_pid(output: str) -> int:
    m = re.search(r"private redis-server \(pid (\d+)\)", output)
    assert m, output
    return int(m.group(1))


def scrape(url: str) -> str:
    return urllib.request.urlopen(url, timeout=5).read().decode()


def test_grpo_run_end_to_end(demo_model_dir: Path, tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    run_dir = tmp_path / "run"
    log = tmp_path / "grpo-run.log"
    proc = processes.grpo("run", "--plain", *SHORT, "-o", f"run.dir={run_dir}", log=log)

    # While it runs, every process answers /metrics with its grpo_ metrics, and /healthz.
    endpoints_file = run_dir / "endpoints.json"
    assert wait_until(endpoints_file.exists, 120), log.read_text()
    endpoints = json.loads(endpoints_file.read_text())
    assert [e["role"] for e in endpoints] == ["learner", "actor", "actor"]
    for e in endpoints:
        assert set(e) == {"role", "name", "pid", "metrics_url"} and e["metrics_url"].startswith("http://127.0.0.1:")
        body = scrape(e["metrics_url"])
        assert ("grpo_learner_step" if e["role"] == "learner" else "grpo_actor_groups_produced_total") in body
        assert "grpo_redis_errors_total" in body
        assert json.loads(scrape(e["metrics_url"].replace("/metrics", "/healthz")))["ok"] is True

    assert proc.wait(timeout=300) == 0, log.read_text()
    out = log.read_text()

    # Nothing is left running: not the children, not the private Redis.
    for pid in [e["pid"] for e in endpoints] + [redis_pid(out)]:
        assert wait_until(lambda p=pid: not pid_alive(p), 10), f"pid {pid} still alive"

    # The run directory: metrics.jsonl, config.json, endpoints.json, summary.json, published weights.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(21))
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 10, 20]
    assert all(0.0 <= r["reward"] <= 1.0 for r in rows[1:])
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["run"]["steps"] == 20 and cfg["run"]["dir"] == str(run_dir) and cfg["model"]["path"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["unexplained"] == 0
    assert summary["groups_trained"] == 20 * 8
    assert summary["groups_produced"] == (
        summary["groups_trained"] + sum(summary["groups_dropped"].values()) + summary["groups_dead"]
        + summary["groups_in_stream"]
    )  # fmt: skip
    # The summary prints the accounting equation.
    assert re.search(
        r"accounting: produced \d+ = trained 160 \+ dropped \d+ \+ dead 0 \+ pending 0 \+ unread \d+ +\(balanced\)", out
    )
    weights = sorted((run_dir / "weights").iterdir())
    assert [w.name for w in weights] == ["v000018", "v000019", "v000020"]
    assert sorted(c.name for c in (run_dir / "checkpoints").glob("step-*")) == ["step-000019", "step-000020"]
    # Nothing pickled: weights are safetensors only.
    files = {f.suffix for w in weights for f in w.iterdir()}
    assert ".safetensors" in files and not files & {".bin", ".pt", ".pth", ".pkl", ".pickle"}
    # Each version is a directory SGLang (or from_pretrained) loads as it is: config, tokenizer, safetensors.
    for w in weights:
        assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= {
            f.name for f in w.iterdir()
        }
    assert (run_dir / "logs" / "learner.log").exists() and (run_dir / "logs" / "actor-1.log").exists()


def _start_long_run(tmp_path: Path, processes, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    run_dir = tmp_path / "run"
    log = tmp_path / "grpo-run.log"
    proc = processes.grpo("run", "--plain", "-o", "run.steps=100000", "-o", f"run.dir={run_dir}", log=log, env=env)
    assert wait_until((run_dir / "endpoints.json").exists, 120), log.read_text()
    assert wait_until(
        lambda: (run_dir / "metrics.jsonl").exists() and len((run_dir / "metrics.jsonl").read_text().splitlines()) > 2,
        120,
    )
    endpoints = json.loads((run_dir / "endpoints.json").read_text())
    return proc, log, endpoints


def test_a_dead_actor_stops_the_run_with_the_reason(demo_model_dir: Path, tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    proc, log, endpoints = _start_long_run(tmp_path, processes)
    victim = next(e for e in endpoints if e["name"] == "actor-1")
    import os

    os.kill(victim["pid"], signal.SIGKILL)
    assert proc.wait(timeout=60) == 1
    out = log.read_text()
    assert f"actor-1 (pid {victim['pid']}) exited with code -9" in out
    for pid in [e["pid"] for e in endpoints] + [redis_pid(out)]:
        assert wait_until(lambda p=pid: not pid_alive(p), 15), f"pid {pid} still alive"


def test_ctrl_c_stops_every_process(demo_model_dir: Path, tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    proc, log, endpoints = _start_long_run(tmp_path, processes)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 128 + signal.SIGINT
    assert time.monotonic() - t0 < 30
    out = log.read_text()
    assert "interrupted" in out
    for pid in [e["pid"] for e in endpoints] + [redis_pid(out)]:
        assert wait_until(lambda p=pid: not pid_alive(p), 15), f"pid {pid} still alive"


def test_the_private_redis_wants_the_runs_password(demo_model_dir: Path, tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    import redis

    # An ACL user in the operator's environment (for another Redis) must not reach the children: the private server
    # knows only its default user.
    proc, log, endpoints = _start_long_run(tmp_path, processes, env={"GRPO_REDIS_USERNAME": "someone-else"})
    run_dir = tmp_path / "run"
    password_file = run_dir / "redis" / "password"
    password = password_file.read_text().strip()
    assert len(password) >= 32 and password_file.stat().st_mode & 0o077 == 0
    url = json.loads((run_dir / "config.json").read_text())["redis"]["url"]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url).ping()
    assert redis.Redis.from_url(url, password=password).ping()
    # No process of the run carries it on its command line.
    for pid in [e["pid"] for e in endpoints] + [redis_pid(log.read_text())]:
        assert password not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    assert password not in (run_dir / "config.json").read_text()
    # The operator's commands, as docs/operations.md shows them: the run's config.json and the password from its file.
    env = {"GRPO_REDIS_PASSWORD": password}
    for command in (["status"], ["dead"]):
        out = tmp_path / f"{command[0]}.log"
        assert processes.grpo(*command, "--config", str(run_dir / "config.json"), log=out, env=env).wait(60) == 0, (
            out.read_text()
        )
    assert "balanced" in (tmp_path / "status.log").read_text()
    refused = processes.grpo("status", "--config", str(run_dir / "config.json"), log=tmp_path / "refused.log")
    assert refused.wait(60) == 2 and "authentication failed" in (tmp_path / "refused.log").read_text()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 128 + signal.SIGINT


def test_nothing_is_pickled_anywhere() -> None:
    """No product module imports a pickle-family serializer, torch.save/torch.load, or multiprocessing (which pickles
    what it sends); processes talk msgpack and safetensors only."""
    root = Path(__file__).resolve().parents[2]
    pattern = re.compile(
        r"^\s*(import|from)\s+(pickle|cPickle|cloudpickle|dill|marshal|shelve|joblib|multiprocessing)\b"
        r"|torch\.(save|load)\(|\bpickle\.(dumps?|loads?)\(",
        re.M,
    )
    offenders = [
        str(p.relative_to(root))
        for pkg in ("actor", "learner", "grader", "common", "ops")
        for p in (root / pkg).rglob("*.py")
        if pattern.search(p.read_text())
    ]
    assert offenders == []
    assert sys.version_info >= (3, 10)


def test_actors_zero_says_what_to_start_and_the_view_says_what_it_waits_for(  # type: ignore[no-untyped-def]
    tiny_model_dir: Path, tmp_path: Path, processes
) -> None:
    """`run.actors=0`: grpo run prints the exact `grpo actor` command (the password by its file, never itself); the
    plain lines say what the start waits for, then the elapsed time and an ETA with each step."""
    run_dir = tmp_path / "run"
    log = tmp_path / "grpo-run.log"
    settings = ["-o", "run.actors=0", "-o", "run.steps=3", "-o", "learner.batch_groups=4", "-o", "learner.eval_every=3",
                "-o", "actor.prompts_per_round=4", "-o", f"model.path={tiny_model_dir}"]  # fmt: skip
    proc = processes.grpo("run", "--plain", *settings, "-o", f"run.dir={run_dir}", log=log)
    waiting = "waiting for groups from the actors you start (run.actors=0): 0 of the 4 that step 1 takes"
    assert wait_until(lambda: waiting in log.read_text() or proc.poll() is not None, 180), log.read_text()
    out = log.read_text()
    m = re.search(
        r'start each actor on this machine .* with: GRPO_REDIS_PASSWORD="\$\(cat (\S+)\)" grpo (actor .+?) \(', out
    )
    assert m, out
    password = Path(m.group(1)).read_text().strip()
    assert m.group(1) == str(run_dir / "redis" / "password") and password not in out
    # As printed: its -o redis.url wins over a GRPO_REDIS_URL the operator's shell may hold for another Redis.
    env = {"GRPO_REDIS_PASSWORD": password, "GRPO_REDIS_URL": "redis://127.0.0.1:1/0"}
    actor = processes.grpo(*shlex.split(m.group(2)), log=tmp_path / "actor.log", env=env)
    assert proc.wait(timeout=300) == 0, log.read_text()
    assert actor.wait(timeout=60) == 0 and "the learner finished the run" in (tmp_path / "actor.log").read_text()

    out = log.read_text()
    lines = out.splitlines()
    first = lines.index(next(line for line in lines if "waiting for" in line))
    assert re.fullmatch(r"\[\d+:\d\d\] waiting for the learner to start \(0 of 1 up\), since \d+:\d\d", lines[first]), (
        lines[first]
    )
    # Between the learner's start and the groups: its model load and its step-0 evaluation (a second each at least).
    assert "] waiting for the learner to load the model" in out or "] waiting for the learner to evaluate step 0" in out
    assert re.search(r"^step +3/3 .* elapsed \d+:\d\d  eta 0:00$", out, re.M), out
    assert password not in out
