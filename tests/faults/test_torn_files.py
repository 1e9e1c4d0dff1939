"""Torn files, for real: a `grpo learner` ran 6 steps on a real Redis (checkpoints at steps 2, 4 and 6); then the disk
filled up while it wrote the next row of metrics.jsonl (half a row, no newline) and the newest checkpoint lost the end
of its model file. A new `grpo learner` warns about the torn row, sets the damaged checkpoint aside with one line,
resumes from step 4, trains steps 5 to 8 again on new groups, and the accounting balances."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.children import wait_until
from common.config import RedisConfig
from common.transport import Transport, read_balance
from tests.integration.test_learner_process import WeightsStub, group

pytestmark = [pytest.mark.faults, pytest.mark.slow]


def settings(url: str, model: Path, run_dir: Path, steps: int) -> list[str]:
    values = [
        f"redis.url={url}", f"model.path={model}", f"run.dir={run_dir}", "run.name=torn", f"run.steps={steps}",
        "learner.batch_groups=2", "sampling.group_size=4", "task.eval_size=2", "learner.max_staleness=100",
        "learner.eval_every=1000", "checkpoint.every=2", "checkpoint.keep=3",
    ]  # fmt: skip
    return [a for v in values for a in ("-o", v)]


def test_a_torn_metrics_row_and_a_damaged_newest_checkpoint(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    t = Transport(RedisConfig(url=redis_url), "torn")
    run_dir = tmp_path / "run"
    t.produce([group(tok, 0) for _ in range(12)])
    first = processes.grpo("learner", *settings(redis_url, tiny_model_dir, run_dir, 6), log=tmp_path / "first.log")
    assert first.wait(timeout=240) == 0, (tmp_path / "first.log").read_text()
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-000002", "step-000004", "step-000006"]
    assert read_balance(t).trained == 12

    # The damage: half of step 7's row, and the newest checkpoint's model file cut short.
    metrics = run_dir / "metrics.jsonl"
    rows_before = metrics.read_text()
    with metrics.open("a") as f:
        f.write('{"step": 7, "policy_version": 7, "reward": 0.5, "rew')
    model_file = checkpoints / "step-000006" / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:1000])

    log = tmp_path / "second.log"
    second = processes.grpo("learner", *settings(redis_url, tiny_model_dir, run_dir, 8), log=log)
    # Actors sample with what the new learner announces: a version after every one published before (versions
    # 5 and 6 of the lost checkpoint's steps belong to a dead branch).
    assert wait_until(lambda: (t.latest_weights() or WeightsStub).version > 6, 120), log.read_text()
    t.produce([group(tok, t.latest_weights().version) for _ in range(8)])
    assert second.wait(timeout=240) == 0, log.read_text()
    text = log.read_text()
    assert "Traceback" not in text, text
    damaged = [line for line in text.splitlines() if "is damaged" in line]
    assert len(damaged) == 1 and "step-000006" in damaged[0] and "model.safetensors" in damaged[0], text
    assert "was cut short, left out" in text and "resumed from" in text and "step-000004: step 4" in text, text
    assert (checkpoints / "step-000006.damaged").is_dir()

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(9))  # every step once; the torn row and steps 5-6 replaced
    assert metrics.read_text().startswith("\n".join(rows_before.splitlines()[:5]))  # steps 0-4 kept as they were
    # The damaged checkpoint's groups were trained and acknowledged before it was damaged: Redis counts them, the
    # learner (back at step 4's counters) counted the 8 groups it trained again for steps 5 to 8.
    b = read_balance(t)
    assert b.unexplained == 0 and b.trained == 20 and b.in_stream == 0, b.equation()
    assert rows[-1]["groups_consumed"] == 16
