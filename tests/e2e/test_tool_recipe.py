"""The multi-turn recipe through the real `grpo run`: the demo model's calculator variant learns to call the tool
(held-out accuracy rises, and not with its rewards shuffled), and a tool that hangs or dies ends its episodes with a
counted reason while the run goes on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RECIPE = ["run", "--plain", "--config", "configs/calculator-tool.yaml"]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def accuracy(run_dir: Path) -> list[float]:
    return [r["eval/accuracy"] for r in rows(run_dir) if "eval/accuracy" in r]


def run(processes, tmp_path: Path, name: str, *overrides: str) -> tuple[Path, str]:  # type: ignore[no-untyped-def]
    run_dir, log = tmp_path / name, tmp_path / f"{name}.log"
    args = [*RECIPE, "-o", f"run.dir={run_dir}", "-o", "run.steps=30", *overrides]
    assert processes.grpo(*args, log=log).wait(timeout=600) == 0, log.read_text()
    return run_dir, log.read_text()


def test_the_calculator_recipe_learns_to_call_the_tool_and_the_control_does_not(tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    learnt, out = run(processes, tmp_path, "learn")
    assert "(balanced)" in out
    first, *_, last = accuracy(learnt)
    assert first < 0.4 and last >= 0.9, accuracy(learnt)
    assert all(r["tokens/env_frac"] > 0 for r in rows(learnt)[1:])  # every batch held tool results
    control, _ = run(processes, tmp_path, "control", "-o", "run.shuffle_rewards=true")
    assert accuracy(control)[-1] < 0.6, accuracy(control)


def test_a_hanging_or_dying_tool_ends_episodes_with_a_reason_while_the_run_goes_on(tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    # Calls naming 77 hang past env.timeout_s, calls naming 99 kill the tool's worker: about 2 % of calls each.
    run_dir, out = run(processes, tmp_path, "faulty", "-o", "run.actors=1", "-o", "env.timeout_s=1",
                       "-o", "env.tool=tests.graders_for_tests:calculator_hangs_on_77_dies_on_99")  # fmt: skip
    assert "(balanced)" in out and rows(run_dir)[-1]["step"] == 30
    actor_log = next((run_dir / "logs").glob("actor*.log")).read_text()
    ends = re.search(r"episodes ended: (.*); (\d+) tool calls answered", actor_log)
    assert ends, actor_log[-2000:]
    counts = dict(kv.rsplit(" ", 1) for kv in ends.group(1).split(", "))
    assert int(counts.get("tool_timeout", 0)) > 0 and int(counts.get("tool_crash", 0)) > 0, counts
