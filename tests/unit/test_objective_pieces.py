"""The objective's other pure pieces: overlong penalty, importance weights, learning-rate schedule, alarms."""

from __future__ import annotations

import math

import pytest
import torch

from common.grpo.advantages import overlong_penalty
from learner.alarms import Alarms
from learner.loss import importance_weights
from learner.schedule import lr_factor


def test_overlong_penalty_dapo_eq13() -> None:
    # L_max 20, L_cache 4: no penalty up to 16 tokens, then linear to -1 at 20.
    assert overlong_penalty([1, 16, 17, 18, 19, 20], 20, 4) == pytest.approx([0, 0, -0.25, -0.5, -0.75, -1.0])
    assert overlong_penalty([18, 30], 20, 4, factor=0.5) == pytest.approx([-0.25, -0.5])
    assert overlong_penalty([20, 20], 20, 0) == [0.0, 0.0]  # off


def test_importance_weights_truncate_and_mask() -> None:
    behaviour = torch.zeros(1, 5)
    ratios = torch.tensor([[1.0, 3.0, 0.25, 1.5, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    w, m = importance_weights(torch.log(ratios), behaviour, mask, cap=2.0, mode="truncate")
    assert w[0].tolist() == pytest.approx([1.0, 2.0, 0.25, 1.5, 0.0])
    assert m == pytest.approx({"is_weight/mean": (1 + 2 + 0.25 + 1.5) / 4, "is_weight/max": 2.0,
                               "is_weight/truncated_frac": 0.25})  # fmt: skip
    w, m = importance_weights(torch.log(ratios), behaviour, mask, cap=2.0, mode="mask")
    assert w[0].tolist() == pytest.approx([1.0, 0.0, 0.0, 1.5, 0.0])  # 3.0 > C and 0.25 < 1/C are dropped
    assert m["is_weight/truncated_frac"] == pytest.approx(0.5)
    with pytest.raises(ValueError):
        importance_weights(behaviour, behaviour, mask, mode="clip")


def test_same_policy_means_weight_one() -> None:
    lp = torch.randn(3, 4)
    w, m = importance_weights(lp, lp, torch.ones(3, 4))
    assert torch.allclose(w, torch.ones(3, 4)) and m["is_weight/truncated_frac"] == 0.0


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        # warm-up (s + 1) / 3 for steps 0-2, then progress (s - 3) / 4 towards 0 at step 7 (after the last one)
        ("constant", [1 / 3, 2 / 3, 1, 1, 1, 1, 1]),
        ("linear", [1 / 3, 2 / 3, 1, 1, 0.75, 0.5, 0.25]),
        ("cosine", [1 / 3, 2 / 3, 1, 1, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2]),
    ],
)
def test_lr_schedules(schedule: str, expected: list[float]) -> None:
    got = [lr_factor(s, warmup=3, total=7, schedule=schedule) for s in range(7)]
    assert got == pytest.approx(expected)


def test_alarms_need_a_streak_fire_once_and_rearm() -> None:
    a = Alarms(window=3, clip_ratio=0.2, zero_std=0.9)
    high = {"clip_ratio/region_mean": 0.3, "frac_reward_zero_std": 0.1}
    low = {"clip_ratio/region_mean": 0.1, "frac_reward_zero_std": 0.1}
    assert a.update(high) == [] and a.update(high) == []
    (msg,) = a.update(high)
    assert "learning rate is likely too large" in msg and a.active["clip_ratio"]
    assert a.update(high) == []  # once
    assert a.update(low) == [] and not a.active["clip_ratio"]
    for _ in range(2):
        a.update(high)
    assert len(a.update(high)) == 1  # re-armed
    zs = {"clip_ratio/region_mean": 0.0, "frac_reward_zero_std": 0.95}
    raised = [m for _ in range(3) for m in a.update(zs)]
    assert len(raised) == 1 and "too easy or too hard" in raised[0]
