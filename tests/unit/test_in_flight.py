"""actor.weight_updates in_flight, the pure parts: the recompute loop of an in-process engine, the actor's
in-flight updates (when they read Redis, once per announcement a round), the sim engine's pacing, and the learner's
side of per-token versions: each token's age, tokens older than learner.max_staleness left out of the loss, and the
spread of versions per answer."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from actor.engines.recompute import generate_recomputing, joined, unfinished
from actor.weights.mid_round import InFlightUpdates, same_lineage
from common.rollout import Sample, version_runs
from common.schemas import Completion, GroupMessage, WeightsAnnouncement
from learner.batch import assemble, version_spread
from tests.unit.test_trainer import captured_gradients, groups_of, policy, trainer_for

__all__ = ["policy"]  # the fixture, shared with test_trainer


def test_version_runs_and_joined_samples() -> None:
    assert version_runs([3, 3, 4, 4, 4, 6]) == ((3, 2), (4, 3), (6, 1)) and version_runs([]) == ()
    head = Sample([1, 2], [-0.1, -0.2], "length", ((3, 2),))
    assert joined(head, Sample([5], [-0.5], "stop", ((3, 1),))).versions == ((3, 3),)
    both = joined(head, Sample([5, 2], [-0.5, -0.1], "stop", ((4, 2),)))
    assert both == Sample([1, 2, 5, 2], [-0.1, -0.2, -0.5, -0.1], "stop", ((3, 2), (4, 2)))
    assert unfinished(head, 4) and not unfinished(head, 2) and not unfinished(replace(head, finish_reason="stop"), 9)


class Versions:
    """Updates whose version comes due once, after ``after`` questions; loading it moves ``now``."""

    def __init__(self, after: int):
        self.after, self.asked, self.now, self.loads = after, 0, 0, 0

    def due(self) -> bool:
        self.asked += 1
        return self.now == 0 and self.asked > self.after

    def load(self) -> None:
        self.now, self.loads = 1, self.loads + 1


def test_recompute_prefills_the_unfinished_answers_and_gives_them_the_rest_of_the_budget() -> None:
    """A fake engine: each row makes token 10 + step per step, row 1 of prompt 0 stops at its second token; the
    interruption comes after 3 steps."""
    calls: list[tuple[list[list[int]], int, int]] = []
    updates = Versions(after=3)

    def generate(prompts: Any, n: int, most: int, interrupt: Any) -> list[list[Sample]]:
        """Rows in step, as a batched decoder: one token each per step, then the interruption is asked."""
        calls.append(([list(p) for p in prompts], n, most))
        rows: list[list[int]] = [[] for _ in range(len(prompts) * n)]
        for step in range(most):
            for i, tokens in enumerate(rows):
                if not tokens or tokens[-1] != 2:
                    stops = len(prompts[i // n]) == 2 and i % n == 1 and step == 1
                    tokens.append(2 if stops else 10 + step)
            if all(t[-1] == 2 for t in rows) or interrupt():
                break
        out = [Sample(t, [-0.5] * len(t), "stop" if t[-1] == 2 else "length", ((updates.now, len(t)),)) for t in rows]
        return [out[i : i + n] for i in range(0, len(out), n)]

    out = generate_recomputing(generate, [[7, 8], [9]], 2, 6, updates)
    assert updates.loads == 1
    # The unfinished rows, prompt and answer so far, with the rest of the budget.
    assert calls[1] == ([[7, 8, 10, 11, 12, 13], [9, 10, 11, 12, 13], [9, 10, 11, 12, 13]], 1, 2)
    first = out[0][0]
    assert first.token_ids == [10, 11, 12, 13, 10, 11] and first.versions == ((0, 4), (1, 2))
    assert out[0][1].token_ids == [10, 2] and out[0][1].versions == ((0, 2),) and out[0][1].finish_reason == "stop"
    assert all(len(s.token_ids) == 6 for s in (out[0][0], *out[1]))


def ann(version: int) -> WeightsAnnouncement:
    return WeightsAnnouncement(version, f"/w/v{version}", "xxh3-128:" + "a" * 32)


def test_in_flight_updates_read_redis_when_woken_or_now_and_then_and_try_a_version_once_a_round() -> None:
    clock, reads, woken, loaded = [0.0], [0], [False], []
    announced: list[WeightsAnnouncement | None] = [None]

    def newer() -> WeightsAnnouncement | None:
        reads[0] += 1
        return announced[0]

    u = InFlightUpdates(newer, lambda a: loaded.append(a.version) or False, lambda: woken[0], 1.0, lambda: clock[0])
    assert not u.due() and reads[0] == 1
    announced[0] = ann(4)
    assert not u.due() and reads[0] == 1  # not woken, and within a second: Redis is not read at every step
    woken[0] = True
    assert u.due() and reads[0] == 2
    u.load()
    assert loaded == [4] and u.loads == 0  # refused (the load said False): not due again within this round
    assert not u.due()
    clock[0] += 5
    assert not u.due()
    u.new_round()
    assert u.due()
    announced[0] = ann(5)
    u.load()  # what was due is what is loaded
    assert loaded == [4, 4]


def test_a_restarted_learners_version_waits_for_the_round_end() -> None:
    """Versions of another epoch (a learner that restarted from a checkpoint) are not loaded mid-answer: the learner
    ages an answer's tokens by version number within its epoch, which a dead branch's would break."""
    epochs = {7: 1, 8: 1}
    assert same_lineage(epochs, 7, replace(ann(9), epoch=1))
    assert not same_lineage(epochs, 8, replace(ann(9), epoch=2))
    assert same_lineage({}, 8, replace(ann(9), epoch=2))  # the held version's epoch not known: as before
    loaded: list[int] = []
    u = InFlightUpdates(lambda: replace(ann(9), epoch=2), lambda a: loaded.append(a.version), lambda: True,
                        midway=lambda a: same_lineage(epochs, 8, a))  # fmt: skip
    assert not u.due()
    u = InFlightUpdates(lambda: replace(ann(9), epoch=1), lambda a: loaded.append(a.version), lambda: True,
                        midway=lambda a: same_lineage(epochs, 8, a))  # fmt: skip
    assert u.due()


def group(versions: list[list[tuple[int, int]] | None], policy_version: int) -> GroupMessage:
    comps = []
    for i, runs in enumerate(versions):
        n = sum(k for _, k in runs) if runs else 3
        comps.append(Completion(np.arange(5, 5 + n, dtype=np.int32), np.full(n, -0.5, np.float32), float(i % 2),
                                "stop", np.array(runs) if runs else None))  # fmt: skip
    return GroupMessage("p", policy_version, "a", np.array([1, 4], np.int32), comps)


def test_each_token_is_as_old_as_its_version_and_the_spread_is_reported() -> None:
    g1 = group([[(4, 1), (6, 2)], None], policy_version=6)
    g2 = group([None, None], policy_version=5)
    b = assemble([g1, g2], pad_id=0, learner_version=7)
    assert b.staleness.tolist() == [1, 2]
    on = b.loss_mask > 0
    assert [b.token_staleness[i][on[i]].tolist() for i in range(4)] == [[3, 1, 1], [1, 1, 1], [2, 2, 2], [2, 2, 2]]
    assert version_spread(b) == pytest.approx({"staleness/token_mean": 20 / 12, "staleness/token_max": 3.0,
                                                "versions/per_answer": 1.25, "versions/mixed_frac": 0.25,
                                                "tokens/age_0": 0.0, "tokens/age_1": 5 / 12, "tokens/age_2": 6 / 12,
                                                "tokens/age_3plus": 1 / 12})  # fmt: skip


def with_runs(g: GroupMessage, first_version: int, first_logprob: float) -> GroupMessage:
    """``g`` with the first token of each answer longer than one token from ``first_version`` (the rest from
    ``g.policy_version``), that token's behaviour log-prob set to ``first_logprob``."""
    comps = []
    for c in g.completions:
        lp = c.logprobs.copy()
        runs = None
        if len(c.token_ids) > 1:
            lp[0] = first_logprob
            runs = np.array([[first_version, 1], [g.policy_version, len(c.token_ids) - 1]])
        comps.append(replace(c, logprobs=lp, runs=runs))
    return replace(g, completions=comps)


def test_tokens_older_than_max_staleness_are_left_out_of_the_loss(policy) -> None:  # type: ignore[no-untyped-def]
    """Learner at version 5, groups of version 4, max_staleness 2: an answer's first token from version 1 is 4
    versions old and must not count (its behaviour log-prob changes nothing); from version 3 it is 2 old and
    counts (its behaviour log-prob, through the importance weight, changes the gradient)."""
    tok, model = policy
    base = groups_of(tok, model, [4, 4])

    def grad(first_version: int, first_logprob: float) -> tuple[list[torch.Tensor], dict[str, float]]:
        trainer = trainer_for(model, "learner.max_staleness=2", "learner.updates_per_batch=1")
        stats: dict[str, float] = {}
        step = trainer.step
        trainer.step = lambda g, version: stats.update(step(g, 5)) or stats  # type: ignore[method-assign,func-returns-value]
        return captured_gradients(trainer, [with_runs(g, first_version, first_logprob) for g in base]), stats

    (old_a, stats), (old_b, _) = grad(1, -0.1), grad(1, -3.0)
    assert all(torch.equal(a, b) for a, b in zip(old_a, old_b, strict=True))
    assert stats["tokens/stale_masked"] > 0 and stats["staleness/token_max"] == 4
    (fresh_a, fresh_stats), (fresh_b, _) = grad(3, -0.1), grad(3, -3.0)
    assert not all(torch.equal(a, b) for a, b in zip(fresh_a, fresh_b, strict=True))
    assert fresh_stats["tokens/stale_masked"] == 0
    assert fresh_stats["tokens"] == stats["tokens"] + stats["tokens/stale_masked"]


def test_the_sim_engine_paces_a_round_as_a_batched_decoder_and_stamps_each_steps_version(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    import time

    from actor.engines.sim import SimEngine
    from common.config import load_config

    cfg = load_config(overrides=[f"model.path={tiny_model_dir}", "actor.sim_tokens_per_s=4000",
                                 "actor.weight_updates=in_flight", "sampling.max_new_tokens=200"], env={})  # fmt: skip
    prompts = [[1, 2], [3]] * 4  # about 3,200 tokens: 0.8 s, the load after 0.1 s
    plain = SimEngine(cfg, seed=5).generate(prompts, 4)
    engine = SimEngine(cfg, seed=5)
    start = time.perf_counter()

    class AfterATenth:
        def due(self) -> bool:
            return engine.version == 0 and time.perf_counter() - start > 0.1

        def load(self) -> None:
            engine.version = 1

    engine.updates = AfterATenth()
    groups = engine.generate(prompts, 4)
    samples = [s for g in groups for s in g]
    assert [s.token_ids for s in samples] == [s.token_ids for g in plain for s in g]  # the same draws
    splits = {s.versions[0][1] for s in samples if len(s.versions) == 2}
    assert len(splits) == 1, [s.versions for s in samples]  # in step: every answer changed version at one step
    (k,) = splits
    for s in samples:
        assert s.versions == (((0, k), (1, len(s.token_ids) - k)) if len(s.token_ids) > k else ((0, len(s.token_ids)),))
