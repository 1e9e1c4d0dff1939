"""DAPO's dynamic sampling (Yu et al., 2025, §3.2), as a pure decision per group.

A group whose rewards are all equal has zero advantage everywhere and gives no policy gradient; DAPO drops it and
samples more prompts until the batch is full of informative groups. Unbounded, that stalls a run whose model has
solved (or cannot solve) nearly every prompt, so resampling is bounded: after ``max_consecutive`` filtered groups in a
row, the next zero-std group is forwarded with the ``zero_std`` flag. The learner trains on it like any other: its
advantages are 0, so it adds no policy gradient (its tokens still count in the loss's token normaliser, and in the KL
term when β > 0, as every sampled group does in TRL), the run keeps going, and the hit is counted and warned about
once.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

import numpy as np

from common.config import SamplingConfig, ShapingConfig
from common.grpo.advantages import group_std, is_zero_std, overlong_penalty
from common.schemas import FilteredStats


class Decision(Enum):
    SEND = "send"
    FILTER = "filter"
    FORWARD = "forward"  # zero-std, sent anyway because resampling reached its bound


class ZeroStdFilter:
    def __init__(self, enabled: bool, max_consecutive: int):
        self.enabled = enabled
        self.max_consecutive = max_consecutive
        self.consecutive = 0

    def decide(self, rewards: Sequence[float]) -> Decision:
        if not self.enabled or not is_zero_std(rewards):
            self.consecutive = 0
            return Decision.SEND
        if self.consecutive >= self.max_consecutive:
            self.consecutive = 0
            return Decision.FORWARD
        self.consecutive += 1
        return Decision.FILTER


def filtered_stats(rewards: Sequence[float]) -> FilteredStats:
    """What the learner needs to know of a group it will never see."""
    return FilteredStats(
        groups=1,
        zero_std_groups=int(is_zero_std(rewards)),
        completions=len(rewards),
        reward_sum=float(sum(rewards)),
        reward_std_sum=group_std(rewards),
    )


def overlong_penalties(lengths: Sequence[int], sampling: SamplingConfig, shaping: ShapingConfig) -> np.ndarray | None:
    """DAPO's overlong penalty of each completion of a group (common.grpo.advantages.overlong_penalty), computed here
    once: the filter decides on the shaped rewards, so that a group whose answers are all right but differ in length
    is not filtered as if it carried no signal, and the group carries the penalties to the learner, whose advantages
    add these very numbers. None when ``shaping`` is off."""
    if not shaping.enabled():
        return None
    penalty = overlong_penalty(lengths, sampling.max_new_tokens, shaping.overlong_cache, shaping.overlong_factor)
    return np.asarray(penalty, dtype=np.float32)


def shaped(rewards: Sequence[float], penalties: np.ndarray | None) -> list[float]:
    """The rewards the learner computes advantages from: the grader's, plus the penalties when there are any."""
    return list(rewards) if penalties is None else [r + float(p) for r, p in zip(rewards, penalties, strict=True)]
