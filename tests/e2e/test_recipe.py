"""The GSM8K recipe (configs/gsm8k-qwen2.5-0.5b.yaml) end to end on this machine: the real `grpo run` and
`grpo eval` with the recipe's task, grader, loss and mixed precision, on GSM8K read from a local directory; only the
model (the tiny demo model for Qwen2.5-0.5B-Instruct), the device (the CPU, with the local engine instead of the
recipe's SGLang servers sized for GPUs) and the sizes are overridden."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "gsm8k-qwen2.5-0.5b.yaml"


def test_the_gsm8k_recipe_runs_on_cpu_with_the_tiny_model(shared_dir: Path, tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("datasets", reason="the data extra (datasets) is not installed")
    gsm8k = shared_dir / "data" / "gsm8k"
    if not gsm8k.is_dir():
        pytest.skip(f"{gsm8k} is absent")
    run_dir = tmp_path / "run"
    here = [
        "-o", "model.device=cpu", "-o", "actor.engine=local", "-o", f"task.path={gsm8k}", "-o", "task.subset=",
        # The tiny model has 128 positions: the question's first 40 characters, and short answers.
        "-o", "task.prompt_template={question:.40} ####", "-o", "sampling.max_new_tokens=16",
        "-o", "task.eval_size=4", "-o", f"run.dir={run_dir}", "-o", "weights.dir=", "-o", "metrics.host=127.0.0.1",
    ]  # fmt: skip
    small = [
        "-o", "run.steps=3", "-o", "learner.batch_groups=2", "-o", "sampling.group_size=4",
        "-o", "actor.prompts_per_round=2", "-o", "learner.updates_per_batch=1", "-o", "learner.grad_accum=2",
        "-o", "actor.max_consecutive_filtered=1", "-o", "learner.warmup_steps=0",
    ]  # fmt: skip
    tiny = ["-o", "model.path="]  # empty under grpo run: the demo model
    run = processes.grpo("run", "--plain", "--config", str(RECIPE), *tiny, *here, *small, log=tmp_path / "run.log")
    assert run.wait(timeout=300) == 0, (tmp_path / "run.log").read_text()
    cfg = json.loads((run_dir / "config.json").read_text())
    assert (cfg["learner"]["loss_type"], cfg["learner"]["autocast"], cfg["grader"]["name"]) == (
        "dapo", "auto", "gsm8k"
    )  # fmt: skip
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and "eval/accuracy" in rows[-1]
    published = json.loads((run_dir / "weights" / "v000003" / "config.json").read_text())
    assert published.get("dtype", published.get("torch_dtype")) == "bfloat16"  # weights.dtype of the recipe

    out = tmp_path / "eval.json"
    model = str(run_dir / "weights" / "v000003")
    done = subprocess.run(
        [sys.executable, "-m", "common.cli", "eval", "--config", str(RECIPE), "--model", model, "--n", "2",
         "--out", str(out), *here],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["problems"] == 4 and report["grader"] == "gsm8k" and set(report) >= {"pass_at_1", "pass_at_n"}
