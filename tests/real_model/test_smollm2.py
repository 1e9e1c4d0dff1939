"""The real-model recipe on the real model: sampling's memory stays bounded with a 49,152-token vocabulary, and
`grpo run` with configs/smollm2-cpu.yaml trains two learner steps on groups an actor sampled, publishing weights an
actor loads."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.conftest import REPO
from tests.real_model.conftest import RECIPE
from tests.unit.test_generation import probe_memory

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


def test_sampling_from_the_real_model_keeps_no_full_vocabulary_logits(smollm2_dir: Path) -> None:
    probe_memory(str(smollm2_dir), rows=64, steps=48)


def test_two_learner_steps_on_what_an_actor_sampled(smollm2_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "common.cli", "run", "--plain", "--config", str(RECIPE),
           "-o", f"model.path={smollm2_dir}", "-o", f"run.dir={run_dir}", "-o", "run.steps=2", "-o", "run.actors=1",
           "-o", "learner.batch_groups=2", "-o", "actor.prompts_per_round=2", "-o", "actor.filter_zero_std=false",
           "-o", "learner.eval_every=1000", "-o", "task.eval_size=4", "-o", "checkpoint.every=2"]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # real updates of a real model: finite, non-zero gradients on 2 groups of 8
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["groups_consumed"] >= 2 * r["step"]
        assert r["updates_skipped_nonfinite"] == 0 and 0 <= r["reward"] <= 1
    # the published version has every tensor of the model, in the shapes the actor loads
    published = sorted((run_dir / "weights").glob("v*/model.safetensors"))[-1]
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as base, safe_open(str(published), "pt") as new:
        names = list(base.keys())
        assert set(new.keys()) == set(names)
        moved = [k for k in names if not base.get_tensor(k).float().equal(new.get_tensor(k).float())]
        assert moved and all(new.get_slice(k).get_shape() == base.get_slice(k).get_shape() for k in names)
    assert "Traceback" not in (run_dir / "logs" / "actor-1.log").read_text()

    # one actor round on the trained version, loaded the way an actor loads an announced one
    from actor.engines.local import LocalEngine
    from common.config import load_config
    from common.schemas import WeightsAnnouncement
    from common.tasks import PromptEncoder, make_task

    cfg = load_config(str(RECIPE), [f"model.path={smollm2_dir}", f"weights.dir={run_dir / 'weights'}"])
    engine = LocalEngine(cfg, seed=0)
    digest = (published.parent / "digest").read_text().strip()
    version = int(published.parent.name[1:])
    engine.load(WeightsAnnouncement(version=version, uri=str(published.parent), digest=digest))
    assert engine.version == version == 2
    encode = PromptEncoder(engine.tokenizer, cfg.task)
    prompts = [encode(p.prompt) for p in make_task(cfg.task, 0).train[:2]]
    groups = engine.generate(prompts, cfg.sampling.group_size)
    assert [len(g) for g in groups] == [8, 8]
    for s in (s for g in groups for s in g):
        assert 1 <= len(s.token_ids) == len(s.logprobs) <= cfg.sampling.max_new_tokens
        assert all(math.isfinite(lp) and lp <= 0 for lp in s.logprobs)
