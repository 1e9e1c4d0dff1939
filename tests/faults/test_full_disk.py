"""A disk that fills up, and a directory that is read-only, for real: a `grpo learner` (and a whole `grpo run`) that
cannot write its checkpoint exits 2 with one line naming the path and the error, and no traceback. Nothing is lost:
the groups of the steps it trained were not acknowledged (their checkpoint never reached the disk), so the next
learner, started once there is room, takes them over, trains every step, and the accounting balances.

A full disk is simulated without root by limiting the learner's file size (RLIMIT_FSIZE, SIGXFSZ ignored): a write
past the limit fails with EFBIG ("File too large") exactly where a full disk fails with ENOSPC. The limit lets the
published weights and the checkpoint's model file through and stops the optimizer's state, twice their size."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from common.config import RedisConfig
from common.transport import Transport, read_balance
from tests.conftest import REPO
from tests.integration.test_learner_process import group

pytestmark = [pytest.mark.faults, pytest.mark.slow]


def file_size_limit(model: Path) -> Callable[[], None]:
    """For the child: files may grow to 1.25 times the model's size (the weights and the checkpoint's model file fit,
    AdamW's two moments do not)."""
    limit = int((model / "model.safetensors").stat().st_size * 1.25)

    def preexec() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return preexec


def start(processes, args: list[str], log: Path, preexec: Callable[[], None] | None = None) -> subprocess.Popen:  # type: ignore[no-untyped-def]
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "common.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                                cwd=REPO, preexec_fn=preexec)  # fmt: skip
    processes.procs.append(proc)  # stopped by PID at teardown
    return proc


def learner_args(url: str, model: Path, run_dir: Path) -> list[str]:
    values = [
        f"redis.url={url}", f"model.path={model}", f"run.dir={run_dir}", "run.name=disk", "run.steps=4",
        "learner.batch_groups=2", "sampling.group_size=4", "task.eval_size=2", "learner.max_staleness=100",
        "learner.eval_every=1000", "checkpoint.every=2", "weights.dtype=float32",
    ]  # fmt: skip
    return ["learner", *[a for v in values for a in ("-o", v)]]


def last_line(log: Path) -> str:
    return [line for line in log.read_text().splitlines() if line.strip()][-1]


@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_learner_that_cannot_write_its_checkpoint_exits_2_and_loses_nothing(
    fault: str, tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    preexec = None
    if fault == "full":
        preexec = file_size_limit(tiny_model_dir)
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a 0o555 directory anyway: a read-only directory cannot be simulated as root")
        checkpoints.mkdir(parents=True)
        checkpoints.chmod(0o555)

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    t = Transport(RedisConfig(url=redis_url), "disk")
    t.produce([group(tok, 0) for _ in range(8)])
    log = tmp_path / "first.log"
    first = start(processes, learner_args(redis_url, tiny_model_dir, run_dir), log, preexec)
    assert first.wait(timeout=240) == 2, log.read_text()
    line = last_line(log)
    why = "File too large" if fault == "full" else "Permission denied"
    assert line.startswith("grpo learner: cannot write ") and str(checkpoints) in line and why in line, line
    assert "Traceback" not in log.read_text(), log.read_text()
    # Full: steps 1 and 2 were trained, their checkpoint never written: their groups stay pending, unacknowledged.
    # Read-only: the learner could not leave its holder's marker there (learner.fencing) and stopped before reading.
    b = read_balance(t)
    expected = (0, 4, 4, 0) if fault == "full" else (0, 0, 8, 0)
    assert (b.trained, b.pending, b.unread, b.unexplained) == expected, b.equation()
    if fault == "read-only":
        checkpoints.chmod(0o755)
    # No checkpoint, no half-written leftover (holders/ keeps the learner's marker).
    assert not checkpoints.exists() or not any(p.name != "holders" for p in checkpoints.iterdir())

    # Room again: the next learner takes the pending groups over and trains every step.
    log = tmp_path / "second.log"
    second = start(processes, learner_args(redis_url, tiny_model_dir, run_dir), log)
    assert second.wait(timeout=240) == 0, log.read_text()
    assert "took over 4 groups" in log.read_text()
    b = read_balance(t)
    assert (b.trained, b.in_stream, b.unexplained) == (8, 0, 0), b.equation()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and rows[-1]["groups_consumed"] == 8
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-000002", "step-000004"]


def test_grpo_run_whose_learner_fills_the_disk_exits_2_with_its_line(
    demo_model_dir: Path, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    """Every process of `grpo run` inherits the limit; the learner is the one that reaches it, at its first
    checkpoint: `grpo run` stops the others and exits 2 with the learner's one line, not 1 with a log tail."""
    run_dir = tmp_path / "run"
    args = ["run", "--plain", "-o", f"model.path={demo_model_dir}", "-o", f"run.dir={run_dir}", "-o", "run.steps=4",
            "-o", "run.actors=1", "-o", "learner.batch_groups=4", "-o", "actor.prompts_per_round=4",
            "-o", "checkpoint.every=2", "-o", "learner.eval_every=1000", "-o", "weights.dtype=float32"]  # fmt: skip
    log = tmp_path / "run.log"
    proc = start(processes, args, log, file_size_limit(demo_model_dir))
    assert proc.wait(timeout=300) == 2, log.read_text()
    line = last_line(log)
    assert "learner: grpo learner: cannot write " in line and "File too large" in line, log.read_text()
    assert "Traceback" not in log.read_text().split("learner: grpo learner:")[-1]


@pytest.mark.parametrize("role", ["learner", "run"])
def test_a_run_directory_that_cannot_be_made_is_one_line_and_exit_2(
    role: str, tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    """`run.dir` under a file (a path mistake; as root the one a read-only directory cannot simulate)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = [role, "-o", f"run.dir={blocker / 'run'}", "-o", f"model.path={tiny_model_dir}"]
    args += ["-o", f"redis.url={redis_url}"] if role == "learner" else []
    log = tmp_path / "out.log"
    assert processes.grpo(*args, log=log).wait(timeout=120) == 2, log.read_text()
    assert "Traceback" not in log.read_text(), log.read_text()
    assert last_line(log).startswith(f"grpo {role}: {blocker / 'run'}") and "Not a directory" in last_line(log)
