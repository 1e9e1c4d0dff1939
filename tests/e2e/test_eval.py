"""`grpo eval`: the demo model's held-out accuracy before and after a short `grpo run`, with the local engine and
through a launched SGLang stand-in; and the report's arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from actor.evaluate import summarise

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_summary_figures() -> None:
    figures = summarise([1.0, 0.0, 0.0, 1.0], [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.5, 0.0]])
    assert figures == {"accuracy_greedy": 0.5, "mean_at_n": pytest.approx(0.4375), "pass_at_n": 0.5}


def grpo_eval(model: Path, out: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "common.cli", "eval", "--model", str(model), "--n", "4", "--out", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report == json.loads(done.stdout.strip().splitlines()[-1])
    assert report["problems"] == 20 and len(report["per_problem"]) == 20 and report["n"] == 4
    return report


def test_eval_shows_what_a_run_taught(demo_model_dir: Path, tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    before = grpo_eval(demo_model_dir, tmp_path / "before.json")
    assert before["accuracy_greedy"] == 0.0  # the warm start's habit: a space before end-of-sequence

    run_dir = tmp_path / "run"
    run = processes.grpo("run", "--plain", "-o", "run.steps=40", "-o", f"run.dir={run_dir}", log=tmp_path / "run.log")
    assert run.wait(timeout=300) == 0, (tmp_path / "run.log").read_text()
    after = grpo_eval(run_dir / "weights" / "v000040", tmp_path / "after.json")
    assert after["accuracy_greedy"] > before["accuracy_greedy"]
    assert after["mean_at_n"] > before["mean_at_n"]
    final = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert after["accuracy_greedy"] == final["eval/accuracy"]  # the learner's evaluation is the same one

    # The same evaluation through the sglang engine (a stand-in server the command launches): greedy agrees.
    sglang = ["-o", "actor.engine=sglang", "-o", "sglang.launch_module=tests.sglang_standin",
              "-o", f"run.dir={tmp_path / 'eval'}"]  # fmt: skip
    via = grpo_eval(run_dir / "weights" / "v000040", tmp_path / "sglang.json", *sglang)
    assert via["engine"] == "sglang" and via["accuracy_greedy"] == after["accuracy_greedy"]
