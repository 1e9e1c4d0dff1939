"""`grpo run` with experiment trackers: every number of every metrics.jsonl row reaches TensorBoard (read back from
its event files) and W&B (offline, read back from its run file) at its step; without the tracker's package the run
stops at start with one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.tracker_files import (
    as_float32,
    expected_series,
    offline_runs,
    tensorboard_scalars,
    wandb_env,
    wandb_history,
    wandb_records,
    wandb_run,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# The random tiny model, not the warm-started demo: these runs check where the rows go, not what is learnt, and the
# demo's build (a short training) is the slow part of a first `grpo run`. Its groups nearly always score 0 throughout,
# so they are kept rather than filtered (actor.filter_zero_std) for the learner to have batches.
SHORT = [
    "-o", "run.steps=3",
    "-o", "actor.filter_zero_std=false",
    "-o", "learner.batch_groups=4",
    "-o", "learner.eval_every=2",
    "-o", "actor.prompts_per_round=4",
]  # fmt: skip


def test_every_row_reaches_tensorboard_and_wandb(tiny_model_dir: Path, tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    run_dir, log = tmp_path / "run", tmp_path / "grpo-run.log"
    proc = processes.grpo("run", "--plain", *SHORT, "-o", f"model.path={tiny_model_dir}", "-o", f"run.dir={run_dir}",
                          "-o", "run.trackers=[tensorboard, wandb]", log=log, env=wandb_env(tmp_path))  # fmt: skip
    assert proc.wait(timeout=300) == 0, log.read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    expected = expected_series(rows)
    assert {"reward", "loss", "clip_ratio/low_mean", "time/step_s", "eval/accuracy"} <= expected.keys()

    assert tensorboard_scalars(run_dir / "tensorboard") == as_float32(expected)

    [run_file] = offline_runs(run_dir)
    records = wandb_records(run_file)
    assert wandb_history(records) == expected
    run = wandb_run(records)
    assert (run.project, run.display_name) == ("grpo-pipeline", "default")
    assert "trackers: tensorboard, wandb" in (run_dir / "logs" / "learner.log").read_text()


def test_a_tracker_without_its_package_stops_the_run_at_start_in_one_line(
    tiny_model_dir: Path, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    """A `tensorboard` package that fails to import, found first on the path, stands for one not installed."""
    stub = tmp_path / "stub" / "tensorboard"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError(\"No module named 'tensorboard'\")\n")
    path = os.pathsep.join(p for p in (str(stub.parent), os.environ.get("PYTHONPATH", "")) if p)
    run_dir, log = tmp_path / "run", tmp_path / "grpo-run.log"
    proc = processes.grpo("run", "--plain", *SHORT, "-o", f"model.path={tiny_model_dir}", "-o", f"run.dir={run_dir}",
                          "-o", "run.trackers=[tensorboard]", log=log, env={"PYTHONPATH": path})  # fmt: skip
    assert proc.wait(timeout=180) == 2, log.read_text()
    out = log.read_text()
    assert "Traceback" not in out
    [line] = [line for line in out.splitlines() if "run.trackers" in line]
    assert "config error: run.trackers: tensorboard needs a package that is not installed" in line
    assert "pip install 'grpo-pipeline[tensorboard]'" in line
    assert not (run_dir / "metrics.jsonl").exists()  # not one step was trained
