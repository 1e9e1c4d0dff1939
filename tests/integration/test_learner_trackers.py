"""A real `grpo learner` that stops after its checkpoint and a second one that resumes from it: the trackers hold
each step once, with the values metrics.jsonl holds, and W&B's run continues under the same id. Under torchrun, rank 0
alone writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import RedisConfig
from common.transport import Transport
from tests.integration.test_distributed_learner import BATCH, sampled_groups, train
from tests.integration.test_learner_process import group
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

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def learner(processes, url: str, model: Path, tmp: Path, steps: int, log: str) -> None:  # type: ignore[no-untyped-def]
    settings = [
        f"redis.url={url}", f"model.path={model}", f"run.dir={tmp / 'run'}", "run.name=tracked", f"run.steps={steps}",
        "run.trackers=[tensorboard, wandb]", "learner.batch_groups=2", "sampling.group_size=4", "task.eval_size=2",
        "learner.max_staleness=100", "checkpoint.every=1",
    ]  # fmt: skip
    proc = processes.grpo("learner", *[a for o in settings for a in ("-o", o)], log=tmp / log, env=wandb_env(tmp))
    assert proc.wait(timeout=180) == 0, (tmp / log).read_text()


def test_a_resumed_learner_continues_the_trackers_at_its_step(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    t = Transport(RedisConfig(url=redis_url), "tracked")
    t.produce([group(tok, 0) for _ in range(4)])
    learner(processes, redis_url, tiny_model_dir, tmp_path, 2, "first.log")
    t.produce([group(tok, 2) for _ in range(4)])
    learner(processes, redis_url, tiny_model_dir, tmp_path, 4, "second.log")
    t.close()
    assert "resumed from" in (tmp_path / "second.log").read_text()

    run_dir = tmp_path / "run"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    expected = expected_series(rows)
    assert tensorboard_scalars(run_dir / "tensorboard") == as_float32(expected)

    first, second = (wandb_records(f) for f in offline_runs(run_dir))
    assert wandb_run(first).run_id == wandb_run(second).run_id  # one W&B run: the resumed learner continues it
    assert wandb_history(first) == expected_series(rows[:3])
    assert wandb_history(second) == expected_series(rows[3:])


def test_under_torchrun_rank_zero_alone_writes_the_tracker(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    t = Transport(RedisConfig(url=redis_url), "ranks")
    t.ensure_consumer_group()
    t.produce(sampled_groups(tiny_model_dir, BATCH * 2))
    t.close()
    rows = train(processes, 2, redis_url, tiny_model_dir, tmp_path, "ranks", 2, "run.trackers=[tensorboard]")
    assert len(list((tmp_path / "ranks" / "tensorboard").iterdir())) == 1  # one event file: rank 0's
    assert tensorboard_scalars(tmp_path / "ranks" / "tensorboard") == as_float32(expected_series(rows))
