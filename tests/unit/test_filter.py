"""actor.filter: DAPO dynamic sampling, bounded, on rewards shaped by the overlong penalty the group then carries."""

from __future__ import annotations

import numpy as np
import pytest

from actor.filter import Decision, ZeroStdFilter, filtered_stats, overlong_penalties, shaped
from common.grpo.advantages import group_std, is_zero_std, overlong_penalty
from common.schemas import FilteredStats


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
