"""From rewards to advantages, the pure pieces both roles share: group advantages, the zero-std test and statistic,
and DAPO's overlong penalty.

GRPO (Shao et al., 2024, DeepSeekMath §4.1) replaces PPO's value model with a group baseline: every prompt gets G
sampled answers, and each answer's advantage is its reward relative to its own group,

    A_i = (r_i − mean(r_group)) / std(r_group)

and every token of answer i gets A_i. Departures a user can choose (``learner.advantage``):

- ``ddof``: 0 is the population std, as in the seed's worked example; 1 is the Bessel-corrected std that TRL uses.
- ``scale``: ``group`` (the paper), ``batch`` (divide by the std of the whole batch, TRL's ``scale_rewards="batch"``),
  ``none`` (Dr. GRPO, Liu et al., 2025: dividing by the group std over-weights groups that are nearly all right or all
  wrong, so it only centres).
- A group whose rewards are all equal carries no signal: its advantages are exactly 0 (never NaN), whatever ``eps``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

Scale = Literal["group", "batch", "none"]


def group_advantages(
    rewards: Sequence[float] | torch.Tensor,
    group_size: int,
    *,
    scale: Scale = "group",
    ddof: int = 0,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantages for G groups laid out contiguously (length G × group_size), same layout out.

    >>> [round(a, 2) for a in group_advantages([0.8, 0.3, 0.6, 0.3], 4).tolist()]
    [1.41, -0.94, 0.47, -0.94]
    """
    r = torch.as_tensor(rewards)
    r = r.to(torch.float64) if not r.is_floating_point() else r
    if r.dim() != 1:
        raise ValueError(f"rewards must be one-dimensional, got shape {tuple(r.shape)}")
    if group_size < 1 or r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not split into groups of {group_size}")
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be group, batch or none, not {scale!r}")
    if ddof not in (0, 1) or (ddof == 1 and group_size < 2):
        raise ValueError(f"ddof must be 0 or 1 (1 needs groups of at least 2), got {ddof}")

    groups = r.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale == "group":
        adv = centred / (groups.std(dim=1, correction=ddof, keepdim=True) + eps)
    elif scale == "batch":
        batch_std = r.std(correction=ddof) if r.numel() > ddof else r.new_zeros(())
        adv = centred / (batch_std + eps)
    else:
        adv = centred
    # Equal rewards: the centred values are rounding noise (mean of 0.1, 0.1, 0.1 is not exactly 0.1), and dividing
    # that noise by a near-zero std would invent a signal. Such a group gets exactly 0.
    flat = (groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)).expand_as(adv)
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return adv.reshape(-1)


def is_zero_std(rewards: Sequence[float]) -> bool:
    """All rewards of a group equal: no signal (DAPO filters such groups)."""
    return max(rewards) == min(rewards)


def group_std(rewards: Sequence[float]) -> float:
    """Population std of one group's rewards; ``reward_std`` averages it over groups."""
    n = len(rewards)
    mean = sum(rewards) / n
    return (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5


def overlong_penalty(lengths: Sequence[int], max_len: int, cache: int, factor: float = 1.0) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al., 2025, eq. 13), added to each completion's reward before grouping.

    0 up to ``max_len − cache`` tokens, then falling linearly to ``−factor`` at ``max_len`` (and ``−factor`` beyond):
    a completion that runs into the length limit is told so gradually, instead of scoring like a wrong answer the
    moment it crosses the line. ``cache`` 0 turns it off.

    >>> overlong_penalty([10, 16, 18, 20], max_len=20, cache=4)
    [0.0, 0.0, -0.5, -1.0]
    """
    if cache <= 0 or factor == 0:
        return [0.0] * len(lengths)
    soft = max_len - cache
    return [0.0 if n <= soft else -factor * min(1.0, (n - soft) / cache) for n in lengths]
