"""`grpo eval`: the demo model's held-out accuracy before and after a short `grpo run`, with the local engine and
through a launched SGLang stand-in; and the report's arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.tasks.evaluation import summarise

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_summary_figures() -> None:
    figures = summarise([1.0, 0.0, 0.0, 1.0], [[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.5, 0.0]])
    assert figures == {"pass_at_1": 0.5, "mean_at_n": pytest.approx(0.4375), "pass_at_n": 0.5}
    assert summarise([1.0, 0.5], [[], []]) == {"pass_at_1": 0.5}  # greedy only (--n 0)


def grpo_eval(model: Path, out: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "common.cli", "eval", "--model", str(model), "--n", "4", "--out", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report == json.loads(done.stdout.strip().splitlines()[-1])
    assert report["problems"] == 20 and len(report["per_problem"]) == 20 and report["n"] == 4
    return report


def write_sums(root: Path) -> Path:
    """The demo's problems as a dataset directory of another layout: train.jsonl (80 rows + 5 too long) and
    test.jsonl (20)."""
    import random

    rows = [{"question": f"{a}+{b}", "answer": str(a + b)} for a in range(10) for b in range(10)]
    random.Random(1).shuffle(rows)
    root.mkdir(parents=True)
    # Five training rows too long for the tiny model's 128 positions: actors skip them (and say so).
    long = [{"question": " " * 150 + f"{a}+{a}", "answer": str(2 * a)} for a in range(5)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[20:] + long))
    (root / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:20]))
    return root


def test_eval_shows_what_a_run_taught(demo_model_dir: Path, tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    before = grpo_eval(demo_model_dir, tmp_path / "before.json")
    assert before["pass_at_1"] == 0.0  # the warm start's habit: a space before end-of-sequence

    run_dir = tmp_path / "run"
    run = processes.grpo("run", "--plain", "-o", "run.steps=40", "-o", f"run.dir={run_dir}", log=tmp_path / "run.log")
    assert run.wait(timeout=300) == 0, (tmp_path / "run.log").read_text()
    after = grpo_eval(run_dir / "weights" / "v000040", tmp_path / "after.json")
    assert after["pass_at_1"] > before["pass_at_1"]
    assert after["mean_at_n"] > before["mean_at_n"]
    final = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert after["pass_at_1"] == final["eval/accuracy"]  # the learner's evaluation is the same one

    # The same evaluation through the sglang engine (a stand-in server the command launches): greedy agrees.
    sglang = ["-o", "actor.engine=sglang", "-o", "sglang.launch_module=tests.sglang_standin",
              "-o", f"sglang.python={sys.executable}",
              "-o", f"run.dir={tmp_path / 'eval'}"]  # fmt: skip
    via = grpo_eval(run_dir / "weights" / "v000040", tmp_path / "sglang.json", *sglang)
    assert via["engine"] == "sglang" and via["pass_at_1"] == after["pass_at_1"]


def test_a_run_on_a_dataset_directory_learns_and_eval_reads_its_test_split(
    demo_model_dir: Path, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("datasets", reason="the data extra (datasets) is not installed")
    data = write_sums(tmp_path / "sums")
    template = ["-o", "task.prompt_template={question}="]
    before = grpo_eval(demo_model_dir, tmp_path / "before.json", "--dataset", str(data), *template)
    assert before["task"] == str(data) and before["pass_at_1"] == 0.0

    run_dir = tmp_path / "run"
    task = ["-o", "task.name=dataset", "-o", f"task.path={data}", "-o", "task.eval_size=0", *template]
    run = processes.grpo("run", "--plain", "-o", "run.steps=30", "-o", f"run.dir={run_dir}", *task,
                         log=tmp_path / "run.log")  # fmt: skip
    assert run.wait(timeout=300) == 0, (tmp_path / "run.log").read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["eval/accuracy"] == 0.0 and rows[-1]["reward"] > rows[1]["reward"]
    after = grpo_eval(run_dir / "weights" / "v000030", tmp_path / "after.json", "--dataset", str(data), *template)
    assert after["pass_at_1"] > before["pass_at_1"] and after["mean_at_n"] > before["mean_at_n"]
    assert after["pass_at_1"] == rows[-1]["eval/accuracy"]  # the learner graded the same test split
    assert [p["id"] for p in after["per_problem"]] == [f"eval-{i}" for i in range(20)]
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("actor-*.log"))
    assert "skipping training prompts longer than 124 tokens (one has 15" in logs  # 128 positions - 4 new tokens


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "-o", "task.name=dataset", "-o", "task.path=/nonexistent/rows.jsonl"], "no such file or directory"),
        (["eval", "--model", "{model}", "--dataset", "{data}"], "task.prompt_field: .* has no field 'question'"),
    ],
)
def test_a_wrong_dataset_is_one_line_and_exit_2(demo_model_dir: Path, tmp_path: Path, args: list, message: str) -> None:
    import re

    data = tmp_path / "rows.jsonl"
    data.write_text('{"problem": "1+1", "answer": "2"}\n')
    args = [a.format(model=demo_model_dir, data=data) for a in args]
    done = subprocess.run([sys.executable, "-m", "common.cli", *args, "-o", f"run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and re.search(message, done.stderr), done.stderr
    assert not (tmp_path / "run").exists()  # checked before anything was created


def test_eval_with_combine_counts_right_answers_not_perfect_rewards(demo_model_dir: Path, tmp_path: Path) -> None:
    """The demo model answers "8 " (a space before end-of-sequence): `exact` calls that right. A combine of `exact`
    and a format bonus the model never earns gives it 0.9: still right, with the same pass@1 as `exact` alone."""
    components = "grader.components=[{name: exact, weight: 0.9}, {name: format, pattern: '<answer>.*', weight: 0.1}]"
    alone = grpo_eval(demo_model_dir, tmp_path / "exact.json", "-o", "grader.name=exact")
    combined = grpo_eval(demo_model_dir, tmp_path / "combine.json", "-o", "grader.name=combine", "-o", components)
    assert alone["pass_at_1"] > 0
    assert (combined["pass_at_1"], combined["pass_at_n"]) == (alone["pass_at_1"], alone["pass_at_n"])
    assert [p["greedy"] for p in combined["per_problem"]] == [p["greedy"] for p in alone["per_problem"]]
