"""A real `grpo learner` fed log-probs no sampler produces. Below the schema's floor (−1e30) a message is dead-lettered
with its reason; above it but still extreme (−1e4, in ``old_logprobs: behavior`` mode) every update of the step is
non-finite: none is applied, the step's groups are dropped as ``nonfinite`` (not counted as trained), and
metrics.jsonl stays strict JSON, the step's loss written as null."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from common.config import RedisConfig
from common.schemas import Completion, GroupMessage, encode_group
from common.transport import Transport, read_balance

pytestmark = pytest.mark.integration


def group(tok, logprob: float) -> bytes:  # type: ignore[no-untyped-def]
    prompt = tok("3+5=").input_ids
    answers = [[tok.convert_tokens_to_ids("8"), tok.eos_token_id], [tok.convert_tokens_to_ids("9"), tok.eos_token_id]]
    comps = tuple(
        Completion(np.array(answers[i % 2], np.int32), np.array([logprob, -0.2], np.float32), float(i % 2 == 0), "stop")
        for i in range(4)
    )
    return encode_group(GroupMessage("add-3-5", 0, "test", np.array(prompt, np.int32), comps))


def strict(line: str) -> dict:
    """json.loads that refuses what Python writes for non-finite floats (Infinity, NaN): they are not JSON."""

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_absurd_logprobs_are_dead_lettered_and_nonfinite_updates_are_skipped_and_counted(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    t = Transport(RedisConfig(url=redis_url), "absurd")
    # In stream order: two below the floor, two that poison a behaviour-mode step, four ordinary ones.
    t.produce([group(tok, lp) for lp in [-1e30] * 2 + [-1e4] * 2 + [-0.7] * 4])  # each its own group id
    settings = [
        f"redis.url={redis_url}", f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'run'}", "run.name=absurd",
        "run.steps=3", "learner.batch_groups=2", "sampling.group_size=4", "task.eval_size=2",
        "learner.max_staleness=100",
        "learner.old_logprobs=behavior", "learner.updates_per_batch=2", "learner.eval_every=1000",
    ]  # fmt: skip
    proc = processes.grpo("learner", *[a for o in settings for a in ("-o", o)], log=tmp_path / "learner.log")
    log_text = lambda: (tmp_path / "learner.log").read_text()  # noqa: E731
    assert proc.wait(timeout=180) == 0, log_text()

    b = read_balance(t)
    assert (b.produced, b.trained, b.dead, b.unexplained) == (8, 4, 2, 0), b.equation()
    assert b.dropped == {"nonfinite": 2}, b.dropped
    reasons = [f[b"reason"].decode() for _, f in t.client.xrange(t.keys.dead)]
    assert len(reasons) == 2 and all("logprobs: must be finite and <= 0, and >= -10000" in r for r in reasons)

    rows = [strict(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    poisoned = rows[1]
    assert poisoned["updates_skipped_nonfinite"] == 2 and poisoned["loss"] is None, poisoned
    assert poisoned["groups_consumed"] == 0 and poisoned["groups_dropped"] == 2
    assert all(r["updates_skipped_nonfinite"] == 0 and r["loss"] is not None for r in rows[2:])
    assert rows[-1]["groups_consumed"] == 4 and rows[-1]["groups_dead"] == 2
    assert "dropped as nonfinite" in log_text() and "Traceback" not in log_text()
