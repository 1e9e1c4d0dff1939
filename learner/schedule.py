"""Learning-rate schedule (pure): linear warm-up, then constant, or a linear or cosine decay that would reach 0 one
step after the last (as transformers' schedules)."""

from __future__ import annotations

import math


def lr_factor(step: int, *, warmup: int, total: int, schedule: str) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based) of ``total``.

    >>> [round(lr_factor(s, warmup=2, total=6, schedule="linear"), 2) for s in range(6)]
    [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    """
    if step < warmup:
        return (step + 1) / warmup  # the first step already moves: (step + 1), not step
    if schedule == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {schedule!r}")
