"""actor.weight_updates in_flight with the local engine, on a real Redis, a real published version and the actor's own
load path: a version announced mid-round is loaded between two decode steps, the answers' early tokens carry the old
version and the rest the new one, and every behaviour log-prob is what the engine computed when it sampled the
token: with the old weights before the load; after it, with the new weights attending to keys and values cached
with the old ones (in_flight_kv keep) or recomputed with the new ones (recompute). Under bfloat16 autocast over
float32 weights the same holds: the engine gives exactly the tokens and log-probs of an engine whose every cast is
fresh (autocast caches its bfloat16 copies of the weights for a whole region, which a load mid-region must drop).
The groups the actor sends say so on the wire, stamped with the newest version."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from transformers import AutoModelForCausalLM

from actor.engines.local import LocalEngine
from actor.loop import Actor
from common.config import RedisConfig, load_config
from common.grpo.logprobs import scaled_log_softmax
from common.metrics import ActorMetrics
from common.rollout import Sample
from common.schemas import decode_group
from common.transport import Transport
from common.weights import publish

pytestmark = pytest.mark.integration

PROMPTS = [[1, 5, 9, 4], [1, 7, 3]]
LOAD_AT = 3  # the due() call that announces the new version: the load comes after that many steps


def make_actor(model: Path, run_dir: Path, url: str, kv: str, name: str, autocast: str = "off") -> Actor:
    cfg = load_config(None, [f"model.path={model}", f"run.dir={run_dir}", f"redis.url={url}", f"run.name={name}",
                             "actor.weight_updates=in_flight", f"actor.in_flight_kv={kv}", "sampling.max_new_tokens=12",
                             "sampling.temperature=1.0", f"actor.autocast={autocast}"])  # fmt: skip
    transport = Transport(cfg.redis, cfg.run.name)
    actor = Actor(cfg, "actor-f", transport, LocalEngine(cfg, seed=3), None, ActorMetrics(CollectorRegistry()))  # type: ignore[arg-type]
    actor._pubsub = transport.subscribe_weights()
    return actor


def changed_model(model_dir: Path) -> Any:
    """The next version: every weight moved enough that its log-probs differ from the first's."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    return model


def announce_on(actor: Actor, call: int, announce: Callable[[], None]) -> None:
    """The learner publishes while the round is sampled: at the ``call``-th time the engine asks. The call waits
    until the announcement has reached the actor's subscription: Redis may answer the publisher before the message
    is on the subscriber's socket, so an engine asking at once could find nothing yet on a busy machine and load a
    step or two later (right either way for the actor; the test pins the step)."""
    updates = actor.updates
    assert updates is not None
    real, calls = updates.due, [0]

    def due() -> bool:
        calls[0] += 1
        if calls[0] != call:
            return real()
        announce()
        woken = updates.woken
        updates.woken = lambda: actor._pubsub.get_message(timeout=10.0) is not None  # this once, it waits
        try:
            return real()
        finally:
            updates.woken = woken

    updates.due = due  # type: ignore[method-assign]


def token_logprobs(model: Any, ids: list[int], start: int, past: Any = None, temperature: float = 1.0) -> list[float]:
    """Log-probs of ``ids[start + 1:]`` as the model scores them (at the sampling temperature), from ``ids[start:]``
    on top of ``past`` (the keys and values of ``ids[:start]``) when given."""
    with torch.no_grad():
        out = model(torch.tensor([ids[start:]]), cache=past, use_cache=True)
    logp = scaled_log_softmax(out.logits[0, :-1].float(), temperature)
    nxt = torch.tensor(ids[start + 1 :])
    return logp.gather(1, nxt.view(-1, 1)).squeeze(1).tolist()


def cache_of(model: Any, ids: list[int]) -> Any:
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=True).past_key_values


def expected(old: Any, new: Any, prompt: list[int], s: Sample, kv: str) -> list[float]:
    """What the engine computed for each token of ``s``: tokens before the load with the old weights; after it, with
    the new ones over the old cache (keep: the step that sampled the first new token fed the last old token, with
    the new weights, on the old cache of everything before it) or over everything recomputed."""
    ids = prompt + s.token_ids
    p = len(prompt)
    (_, k), *rest = s.versions
    before = token_logprobs(old, ids[: p + k], 0)[p - 1 :]
    if not rest:
        return before
    if kv == "keep":
        after = token_logprobs(new, ids, p + k - 1, past=cache_of(old, ids[: p + k - 1]))
    else:
        after = token_logprobs(new, ids, 0)[p + k - 1 :]
    return before + after


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_a_version_published_mid_round_takes_over_the_rest_of_each_answer(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, kv: str
) -> None:
    actor = make_actor(tiny_model_dir, tmp_path, redis_url, kv, f"fl-{kv}")
    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    new = changed_model(tiny_model_dir).eval()
    pub = publish(new, None, actor.cfg.weights.dir, 1, keep=2)
    t = Transport(RedisConfig(url=redis_url), f"fl-{kv}")
    announce_on(actor, LOAD_AT, lambda: t.announce_weights(pub.announcement))

    groups = actor.engine.generate(PROMPTS, 3)

    assert actor.engine.version == 1 and actor.updates is not None and actor.updates.loads == 1
    samples = [(prompt, s) for prompt, group in zip(PROMPTS, groups, strict=True) for s in group]
    spanning = [s for _, s in samples if len(s.versions) == 2]
    assert spanning, [s.versions for _, s in samples]
    for prompt, s in samples:
        assert sum(k for _, k in s.versions) == len(s.token_ids)
        assert s.versions[0] == (0, min(LOAD_AT, len(s.token_ids)))  # the old version's tokens come first
        if len(s.token_ids) > LOAD_AT:
            assert s.versions[1] == (1, len(s.token_ids) - LOAD_AT)
        assert s.logprobs == pytest.approx(expected(old, new, prompt, s, kv), abs=1e-4)
    # The new version's tokens are not what the old weights would have given them: the check above can fail.
    prompt, s = next((p, s) for p, s in samples if len(s.versions) == 2)
    assert s.logprobs != pytest.approx(token_logprobs(old, prompt + s.token_ids, 0)[len(prompt) - 1 :], abs=1e-3)


def sample_with_a_load_mid_round(model: Path, run_dir: Path, url: str, kv: str, name: str) -> list[list[Sample]]:
    """The engine's samples (bfloat16 autocast, seed 3) of a round during which version 1 is announced."""
    actor = make_actor(model, run_dir, url, kv, name, autocast="bfloat16")
    pub = publish(changed_model(model), None, actor.cfg.weights.dir, 1, keep=2)
    t = Transport(RedisConfig(url=url), name)
    announce_on(actor, LOAD_AT, lambda: t.announce_weights(pub.announcement))
    groups = actor.engine.generate(PROMPTS, 3)
    assert actor.engine.version == 1 and any(len(s.versions) == 2 for g in groups for s in g)
    return groups


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_under_autocast_a_load_mid_round_computes_with_fresh_casts_of_the_new_weights(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kv: str
) -> None:
    """Exactly the tokens and log-probs of an engine for which autocast caches nothing (every forward casts the
    weights it holds then): a cached cast of the old weights would move every token after the load."""
    groups = sample_with_a_load_mid_round(tiny_model_dir, tmp_path / "cached", redis_url, kv, f"ac-{kv}")
    with monkeypatch.context() as m:
        m.setattr(torch, "autocast", functools.partial(torch.autocast, cache_enabled=False))
        fresh = sample_with_a_load_mid_round(tiny_model_dir, tmp_path / "fresh", redis_url, kv, f"acf-{kv}")
    for ours, theirs in zip(groups, fresh, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            assert (a.token_ids, a.versions) == (b.token_ids, b.versions)
            assert a.logprobs == b.logprobs  # the same casts of the same weights: bit for bit


def test_the_actor_sends_each_answers_versions_and_stamps_its_group_with_the_newest(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    actor = make_actor(tiny_model_dir, tmp_path, redis_url, "keep", "fl-wire")
    actor.cfg.actor.filter_zero_std = False
    pub = publish(changed_model(tiny_model_dir), None, actor.cfg.weights.dir, 1, keep=2)
    t = Transport(RedisConfig(url=redis_url), "fl-wire")
    announce_on(actor, LOAD_AT, lambda: t.announce_weights(pub.announcement))
    problems = actor.next_problems("actor-f").problems[:2]
    prompts = [actor.prompt_ids(p) for p in problems]
    samples = actor.engine.generate(prompts, actor.cfg.sampling.group_size)
    out = actor.outgoing.encode(problems, samples, [[0.0, 1.0] * 4] * len(problems), prompt_ids=actor.prompt_ids,
                                version_sampled=actor.version_sampled, epochs={})  # fmt: skip
    for raw, group in zip(out.payloads, samples, strict=True):
        msg = decode_group(raw)
        newest = max(s.versions[-1][0] for s in group)
        assert msg.policy_version == newest
        for c, s in zip(msg.completions, group, strict=True):
            runs = (
                [tuple(r) for r in c.runs.tolist()] if c.runs is not None else [(msg.policy_version, len(s.token_ids))]
            )
            assert runs == list(s.versions)
