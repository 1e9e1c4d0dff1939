"""A user's own environment class, chosen from the config, through the real `grpo run`: the example environment
(examples/environments/try_again.py) answers wrong answers with feedback in the actors' episodes and in the learner's
evaluation, and a class that cannot be built is one line and exit 2 before any process starts."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TRY_AGAIN = ["-o", "env.name=examples.environments.try_again:TryAgain", "-o", "env.max_turns=3"]


def test_a_users_environment_class_samples_the_runs_episodes(tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    args = ["run", "--plain", "-o", f"run.dir={run_dir}", "-o", "run.steps=8", "-o", "learner.eval_every=4", *TRY_AGAIN,
            "-o", "env.args.feedback=\" no:\""]  # fmt: skip
    assert processes.grpo(*args, log=log).wait(timeout=600) == 0, log.read_text()
    assert "(balanced)" in log.read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 8 and any(r.get("tokens/env_frac", 0) > 0 for r in rows[1:])  # feedback in the batches
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 4, 8]  # evaluated in episodes, as trained
    for actor_log in (run_dir / "logs").glob("actor*.log"):
        ends = re.search(r"episodes ended: (.*); (\d+) tool calls answered", actor_log.read_text())
        assert ends, actor_log.read_text()[-2000:]
        counts = {k: int(v) for k, v in (kv.rsplit(" ", 1) for kv in ends.group(1).split(", "))}
        # Right at once or after feedback (answer), or wrong three times (max_turns); the environment never failed
        assert counts.get("answer", 0) > 0 and int(ends.group(2)) > 0, counts
        assert not any(k.startswith("tool_") for k in counts), counts


def test_a_class_its_args_do_not_fit_is_one_line_and_exit_2(tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    # Through the `grpo` script, as the guide's command runs it: the class is imported from the working directory
    # (found, then refused by its constructor), not reported as missing.
    log = tmp_path / "bad.log"
    args = ["run", "--plain", "-o", f"run.dir={tmp_path / 'bad'}", *TRY_AGAIN, "-o", "env.args.colour=red"]
    assert processes.start([str(Path(sys.executable).parent / "grpo"), *args], log).wait(timeout=300) == 2
    errors = [line for line in log.read_text().splitlines() if "config error" in line]
    assert len(errors) == 1 and "env.args" in errors[0] and "colour" in errors[0], log.read_text()
    assert not (tmp_path / "bad").exists()  # refused before the run directory was made
