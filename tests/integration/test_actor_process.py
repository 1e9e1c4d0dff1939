"""A real `grpo actor` process on a real Redis: valid groups, backpressure, weight reload on announce, clean stop."""

from __future__ import annotations

import signal
import time
import urllib.request
from dataclasses import replace
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

pytestmark = pytest.mark.integration


def actor_args(model: Path, run_dir: Path, url: str, *extra: str) -> list[str]:
    return [
        "actor",
        "-o", f"redis.url={url}",
        "-o", f"model.path={model}",
        "-o", f"run.dir={run_dir}",
        "-o", "run.name=it",
        "-o", "actor.id=actor-it",
        "-o", "learner.batch_groups=8",
        "-o", "actor.max_stream_groups=16",
        "-o", "actor.prompts_per_round=4",
        "-o", "run.heartbeat_ttl_s=3",
        *extra,
    ]  # fmt: skip


def metric(url: str, name: str) -> float | None:
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_actor_sends_valid_groups_waits_reloads_and_stops(
    demo_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    t = Transport(RedisConfig(url=redis_url), "it")
    proc = processes.grpo(*actor_args(demo_model_dir, tmp_path, redis_url), log=tmp_path / "actor.log")

    # Groups arrive, and backpressure holds the stream at its bound of 16 unread groups: the actor stops once the
    # next round (up to 4 groups) would not fit, and never writes past it.
    assert wait_until(lambda: t.stream_length() > 16 - 4, 120), (tmp_path / "actor.log").read_text()
    time.sleep(2)
    assert 16 - 4 < t.stream_length() <= 16
    entries = t.client.xrange(t.keys.groups)
    groups = [decode_group(fields[b"data"]) for _, fields in entries]
    for g in groups:
        assert g.actor_id == "actor-it" and g.policy_version == 0 and len(g.completions) == 8
        assert g.epoch is None  # model.path, never announced: no epoch to stamp
        rewards = g.rewards
        assert max(rewards) != min(rewards) or g.zero_std  # zero-std groups are filtered out (or flagged)
    stats = t.stats()
    assert stats["groups_produced"] == len(groups)
    assert t.live_actors()["actor-it"].version == 0

    # New weights: announce version 5 and drain the stream so the actor generates again.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo_model_dir)
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)  # a different policy, visibly
    # Of the learner's epoch 2 (one that resumed after a crash): the actor stamps it on the groups it samples.
    t.announce_weights(replace(publish(model, tok, tmp_path / "weights", 5, keep=2).announcement, epoch=2))
    t.client.delete(t.keys.groups)

    def sent() -> list:  # type: ignore[type-arg]
        return [decode_group(f[b"data"]) for _, f in t.client.xrange(t.keys.groups)]

    # A round sampled with version 0 may still have been waiting for room; everything after it is version 5.
    assert wait_until(lambda: sum(g.policy_version == 5 for g in sent()) >= 2, 60)
    versions = [g.policy_version for g in sent()]
    assert set(versions) <= {0, 5} and versions == sorted(versions)
    fresh = [g for g in sent() if g.policy_version == 5]
    assert all(g.epoch == 2 for g in fresh)
    # The behaviour log-probs are those of the new weights: the actor really loaded them.
    g = fresh[0]
    for c in g.completions:
        ids = torch.tensor([np.concatenate([g.prompt_ids, c.token_ids]).tolist()])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(g.prompt_ids) - 1 : -1]
        assert token_logprobs(logits, torch.from_numpy(c.token_ids.astype(np.int64))).tolist() == pytest.approx(
            c.logprobs.tolist(), abs=1e-4
        )

    url = (tmp_path / "endpoints.d" / "actor-actor-it.json").read_text()
    import json

    metrics_url = json.loads(url)["metrics_url"]
    assert metric(metrics_url, "grpo_actor_policy_version") == 5
    assert metric(metrics_url, 'grpo_actor_weight_load_seconds_count{transport="disk"}') == 1
    assert (metric(metrics_url, "grpo_actor_backpressure_wait_seconds_total") or 0) > 0
    assert (metric(metrics_url, "grpo_actor_groups_produced_total") or 0) >= len(groups)

    # SIGTERM: the actor finishes its round and exits 0; every entry in the stream is a whole, valid group.
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    for _, fields in t.client.xrange(t.keys.groups):
        decode_group(fields[b"data"])
    assert t.stats()["groups_produced"] >= len(groups) + len(fresh)


def test_actor_exits_when_the_run_is_done(demo_model_dir: Path, redis_url: str, tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    t = Transport(RedisConfig(url=redis_url), "it")
    # Started (or restarted by a supervisor) after the run finished: it exits at once, sending nothing.
    t.mark_done()
    late = processes.grpo(*actor_args(demo_model_dir, tmp_path, redis_url), log=tmp_path / "late.log")
    assert late.wait(timeout=120) == 0
    assert "the learner finished the run" in (tmp_path / "late.log").read_text()
    assert t.stream_length() == 0

    # Running when the learner finishes: it stops too.
    t.clear_done()
    proc = processes.grpo(*actor_args(demo_model_dir, tmp_path, redis_url), log=tmp_path / "actor.log")
    assert wait_until(lambda: t.stream_length() > 0, 120)
    t.mark_done()
    assert proc.wait(timeout=30) == 0
    assert "the learner finished the run" in (tmp_path / "actor.log").read_text()
