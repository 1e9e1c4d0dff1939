"""actor.filter (DAPO dynamic sampling, bounded) and learner.batch (tensor layout, sampled reward statistics)."""

from __future__ import annotations

import numpy as np
import pytest

from actor.filter import Decision, ZeroStdFilter, filtered_stats, overlong_penalties, shaped
from common.grpo.advantages import group_std, is_zero_std, overlong_penalty
from common.schemas import Completion, FilteredStats, GroupMessage
from learner.batch import assemble, sampled_reward_stats


def test_zero_std_groups_are_filtered_and_informative_ones_sent() -> None:
    f = ZeroStdFilter(enabled=True, max_consecutive=10)
    assert f.decide([1.0, 0.0, 1.0]) is Decision.SEND
    assert f.decide([1.0, 1.0, 1.0]) is Decision.FILTER
    assert f.decide([0.0, 0.0, 0.0]) is Decision.FILTER
    assert f.decide([0.5, 0.5, 0.5]) is Decision.FILTER


def test_resampling_is_bounded_then_a_flagged_group_goes_through() -> None:
    f = ZeroStdFilter(enabled=True, max_consecutive=3)
    decisions = [f.decide([1.0, 1.0]) for _ in range(8)]
    assert decisions == [Decision.FILTER] * 3 + [Decision.FORWARD] + [Decision.FILTER] * 3 + [Decision.FORWARD]
    # An informative group resets the count.
    f.decide([1.0, 1.0])
    f.decide([1.0, 0.0])
    assert [f.decide([0.0, 0.0]) for _ in range(3)] == [Decision.FILTER] * 3


def test_disabled_filter_sends_everything() -> None:
    f = ZeroStdFilter(enabled=False, max_consecutive=1)
    assert {f.decide([1.0, 1.0]) for _ in range(5)} == {Decision.SEND}


def test_filtered_stats_summarise_a_group() -> None:
    assert is_zero_std([0.3, 0.3]) and not is_zero_std([0.3, 0.4])
    assert group_std([0.8, 0.3, 0.6, 0.3]) == pytest.approx(0.045**0.5)
    s = filtered_stats([1.0, 1.0, 1.0, 1.0]) + filtered_stats([0.0, 1.0, 0.0, 0.0])
    assert s == FilteredStats(
        groups=2, zero_std_groups=1, completions=8, reward_sum=5.0, reward_std_sum=pytest.approx(0.75**0.5 / 2)
    )


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


def test_the_filter_decides_on_the_penalties_the_group_then_carries() -> None:
    from common.config import SamplingConfig, ShapingConfig

    sampling, off = SamplingConfig(max_new_tokens=8), ShapingConfig()
    assert overlong_penalties([3, 8], sampling, off) is None and shaped([1.0, 1.0], None) == [1.0, 1.0]
    on = ShapingConfig(overlong_cache=4, overlong_factor=0.5)
    penalties = overlong_penalties([3, 6, 8], sampling, on)
    assert penalties is not None and penalties.dtype == np.float32
    assert penalties.tolist() == pytest.approx(overlong_penalty([3, 6, 8], 8, 4, 0.5)) == [0.0, -0.25, -0.5]
    # All right, but of different lengths: the shaped rewards differ, so the group is sent, not filtered.
    f = ZeroStdFilter(enabled=True, max_consecutive=8)
    assert f.decide([1.0, 1.0, 1.0]) is Decision.FILTER
    assert f.decide(shaped([1.0, 1.0, 1.0], penalties)) is Decision.SEND
