"""LoRA versions (learner.lora) reaching a real `grpo actor` process with the local engine, on a real Redis: a
version is the adapter alone, the actor applies it over its base, its groups carry the version, and their behaviour
log-probs are the adapted model's; an adapter trained on another base is refused and counted, the actor sampling
on with what it had."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from common.children import wait_until
from common.config import RedisConfig
from common.grpo.logprobs import token_logprobs
from common.schemas import decode_group
from common.transport import Transport
from common.weights import publish
from common.weights.adapters import base_identity
from tests.adapters import adapted
from tests.integration.test_actor_process import actor_args, metric

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::UserWarning")]


def test_an_adapter_version_is_applied_and_stamps_the_groups(
    demo_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    t = Transport(RedisConfig(url=redis_url), "it")
    proc = processes.grpo(*actor_args(demo_model_dir, tmp_path, redis_url), log=tmp_path / "actor.log")
    assert wait_until(lambda: t.stream_length() > 0, 120), (tmp_path / "actor.log").read_text()

    base = AutoModelForCausalLM.from_pretrained(demo_model_dir).eval()
    policy = adapted(base, seed=3)
    identity = base_identity(str(demo_model_dir))
    pub = publish(policy, None, tmp_path / "weights", 3, keep=3, base=identity)
    full = publish(base, None, tmp_path / "full", 3, keep=1)
    assert pub.announcement.format == "lora-safetensors"
    assert {p.name for p in Path(pub.announcement.uri).iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors", "base.json", "digest", "lease_token"
    }  # fmt: skip
    assert pub.nbytes * 5 < full.nbytes  # the adapter of every linear layer at rank 4, against the whole model
    t.announce_weights(pub.announcement)
    t.client.delete(t.keys.groups)

    def sent() -> list:  # type: ignore[type-arg]
        return [decode_group(f[b"data"]) for _, f in t.client.xrange(t.keys.groups)]

    assert wait_until(lambda: sum(g.policy_version == 3 for g in sent()) >= 2, 60), (tmp_path / "actor.log").read_text()
    fresh = [g for g in sent() if g.policy_version == 3]
    for c in fresh[0].completions:  # sampled with the adapter: the learner's peft model gives the same log-probs
        g = fresh[0]
        ids = torch.tensor([np.concatenate([g.prompt_ids, c.token_ids]).tolist()])
        with torch.no_grad():
            logits = policy(input_ids=ids).logits[0, len(g.prompt_ids) - 1 : -1]
        assert token_logprobs(logits, torch.from_numpy(c.token_ids.astype(np.int64))).tolist() == pytest.approx(
            c.logprobs.tolist(), abs=1e-4
        )

    # An adapter of the same shapes trained on another base: refused before it is applied, counted; the actor
    # samples on with version 3.
    foreign = {"path": "another-model", "digest": "xxh3-128:" + "0" * 32}
    t.announce_weights(publish(adapted(base, seed=4), None, tmp_path / "weights", 4, keep=3, base=foreign).announcement)
    metrics_url = json.loads((tmp_path / "endpoints.d" / "actor-actor-it.json").read_text())["metrics_url"]
    failures = 'grpo_actor_weight_load_failures_total{reason="mismatch"}'
    t.client.delete(t.keys.groups)
    assert wait_until(lambda: (metric(metrics_url, failures) or 0) >= 1, 60), (tmp_path / "actor.log").read_text()
    assert "another-model" in (tmp_path / "actor.log").read_text()
    assert metric(metrics_url, "grpo_actor_policy_version") == 3
    proc.terminate()
    assert proc.wait(timeout=60) == 0
    assert all(g.policy_version == 3 for g in sent())
