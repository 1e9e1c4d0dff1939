"""learner.batch: the tensor layout of a batch, and the reward statistics over everything sampled."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.schemas import Completion, FilteredStats, GroupMessage
from learner.batch import assemble, micro_batches, sampled_reward_stats


def _group(prompt: list[int], comps: list[tuple[list[int], float]], version: int = 3, **kw: object) -> GroupMessage:
    return GroupMessage(
        prompt_id="p",
        policy_version=version,
        actor_id="a",
        prompt_ids=np.array(prompt, dtype=np.int32),
        completions=tuple(
            Completion(
                np.array(t, np.int32),
                -np.arange(1, len(t) + 1, dtype=np.float32) / 10,
                r,
                "stop" if len(t) < 3 else "length",
            )
            for t, r in comps
        ),
        **kw,  # type: ignore[arg-type]
    )


def test_assemble_places_completion_tokens_and_behaviour_logprobs() -> None:
    g1 = _group([1, 7, 8], [([20, 2], 1.0), ([21, 22, 23], 0.0)], version=4)
    g2 = _group([1, 9], [([24], 0.0), ([25, 2], 1.0)], version=3)
    b = assemble([g1, g2], pad_id=0, learner_version=5)
    assert b.input_ids.tolist() == [
        [1, 7, 8, 20, 2, 0],
        [1, 7, 8, 21, 22, 23],
        [1, 9, 24, 0, 0, 0],
        [1, 9, 25, 2, 0, 0],
    ]
    assert b.attention_mask.sum(1).tolist() == [5, 6, 3, 4]
    # Shifted space: position t predicts token t+1, so a completion starting at index p is masked from p−1.
    assert b.loss_mask.tolist() == [
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
        [0, 1, 0, 0, 0],
        [0, 1, 1, 0, 0],
    ]
    assert b.behavior_logprobs[1].tolist() == pytest.approx([0, 0, -0.1, -0.2, -0.3])
    assert b.behavior_logprobs[3].tolist() == pytest.approx([0, -0.1, -0.2, 0, 0])
    assert b.rewards.tolist() == [1.0, 0.0, 0.0, 1.0] and b.group_size == 2
    assert b.staleness.tolist() == [1, 2]
    assert b.truncated.tolist() == [False, True, False, False]
    assert b.completion_lengths.tolist() == [2, 3, 1, 2]


def test_assemble_rejects_mixed_group_sizes() -> None:
    with pytest.raises(ValueError):
        assemble([_group([1], [([2], 1.0)]), _group([1], [([2], 1.0), ([3], 0.0)])], 0, 0)


def test_sampled_reward_stats_include_what_actors_filtered() -> None:
    # Trained: one group with rewards 1, 0 (std 0.5). Filtered before it: three groups of 2, all 1s (zero std).
    g = _group([1], [([2], 1.0), ([3], 0.0)])
    s = sampled_reward_stats([g], FilteredStats(3, 3, 6, 6.0, 0.0))
    assert s["reward"] == pytest.approx(7 / 8)
    assert s["reward/trained"] == pytest.approx(0.5)
    assert s["frac_reward_zero_std"] == pytest.approx(3 / 4)
    assert s["reward_std"] == pytest.approx(0.5 / 4)
    assert s["groups_sampled"] == 4


def test_micro_batches_by_tokens_group_rows_of_like_length_within_the_budget() -> None:
    lengths = torch.tensor([5, 9, 3, 9, 2, 7, 1, 8])
    rows = torch.tensor([6, 1, 0, 3, 7, 2])  # a shuffled mini-batch of six of the eight rows
    groups = micro_batches(rows, lengths, budget=18)
    assert sorted(torch.cat(groups).tolist()) == sorted(rows.tolist())  # every row once
    assert [g.tolist() for g in groups] == [[1, 3], [7, 0], [2, 6]]  # longest first: 2 x 9, 2 x 8, 2 x 3
    assert all(len(g) * int(lengths[g].max()) <= 18 for g in groups)
    # Two ranks: a micro-batch holds twice the rows (each rank's forward keeps to the budget); every rank computes it.
    assert [g.tolist() for g in micro_batches(rows, lengths, budget=18, world=2)] == [[1, 3, 7, 0], [2, 6]]
    # A row longer than the budget goes alone; under torchrun each micro-batch still has a row for every rank, the
    # budget exceeded if it must, and a short last one joins the one before it.
    assert [g.tolist() for g in micro_batches(rows, lengths, budget=4)] == [[1], [3], [7], [0], [2], [6]]
    assert [g.tolist() for g in micro_batches(rows, lengths, budget=4, world=2)] == [[1, 3], [7, 0], [2, 6]]
    assert [g.tolist() for g in micro_batches(rows, lengths, budget=4, world=4)] == [[1, 3, 7, 0, 2, 6]]
