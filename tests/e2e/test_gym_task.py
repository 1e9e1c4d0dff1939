"""reasoning-gym's tasks through the real `grpo run` and `grpo eval`: the actors sample the generated problems, every
answer is graded by its dataset's own scoring in the grader's worker, the learner evaluates on the held-out ones, and
a dataset the library does not have is one line and exit 2 before anything starts. The demo model cannot solve these
(it only knows single-digit sums and reads capitals as unknown): this is the machinery; the recipe that learns is
SmolLM2's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra is not installed")

# chain_sum's questions are about 70 characters: within the demo model's 128 positions without the tag instruction.
GYM = ["-o", "task.name=reasoning_gym", "-o", "task.datasets=[chain_sum]", "-o", "grader.name=reasoning_gym",
       "-o", "task.prompt_template={question}", "-o", "task.eval_size=8", "-o", "task.train_size=200"]  # fmt: skip


def test_a_run_samples_grades_and_evaluates_reasoning_gym_problems(tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    # Nearly every reward is 0: the zero-std filter would drop every group and the learner would wait for ever.
    args = ["run", "--plain", "-o", f"run.dir={run_dir}", "-o", "run.steps=3", "-o", "actor.filter_zero_std=false",
            "-o", "run.actors=1", *GYM]  # fmt: skip
    assert processes.grpo(*args, log=log).wait(timeout=600) == 0, log.read_text()
    out = log.read_text()
    assert "(balanced)" in out and "task: 200 training prompts, 8 held out" in out, out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 3] and rows[-1]["step"] == 3

    report = tmp_path / "eval.json"
    model = run_dir / "weights" / "v000003"
    cmd = [sys.executable, "-m", "common.cli", "eval", "--model", str(model), "--n", "2", "--out", str(report), *GYM]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["problems"] == 8 and "pass_at_1" in result, result
    assert result["grader_errors"] == {}, result  # every answer judged by its dataset's scoring, none failed


def test_a_dataset_reasoning_gym_does_not_have_is_one_line_and_exit_2(tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    log = tmp_path / "bad.log"
    args = ["run", "--plain", "-o", f"run.dir={tmp_path / 'bad'}", *GYM, "-o", "task.datasets=[chain_summ]"]
    assert processes.grpo(*args, log=log).wait(timeout=300) == 2, log.read_text()
    errors = [line for line in log.read_text().splitlines() if "config error" in line]
    assert len(errors) == 1 and "task.datasets: chain_summ" in errors[0], log.read_text()
    assert not (tmp_path / "bad").exists()
