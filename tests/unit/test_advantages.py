"""common.grpo.advantages.group_advantages against the seed's worked example and a plain loop, and
common.grpo.logprobs.token_logprobs."""

from __future__ import annotations

import math
import random

import pytest
import torch

from common.grpo.advantages import group_advantages
from common.grpo.logprobs import token_logprobs


def test_seed_table() -> None:
    # The seed: scores 0.8, 0.3, 0.6, 0.3; mean 0.5; population std ≈ 0.21.
    adv = group_advantages([0.8, 0.3, 0.6, 0.3], 4)
    assert [round(a, 2) for a in adv.tolist()] == [1.41, -0.94, 0.47, -0.94]
    assert adv.tolist() == pytest.approx(
        [0.3 / math.sqrt(0.045), -0.2 / math.sqrt(0.045), 0.1 / math.sqrt(0.045), -0.2 / math.sqrt(0.045)], abs=1e-4
    )


def test_bessel_std_as_trl() -> None:
    adv = group_advantages([0.8, 0.3, 0.6, 0.3], 4, ddof=1)
    s = math.sqrt(0.18 / 3)
    assert adv.tolist() == pytest.approx([0.3 / s, -0.2 / s, 0.1 / s, -0.2 / s], abs=1e-4)


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 0.7])
@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_equal_rewards_give_exact_zero_never_nan(value: float, eps: float) -> None:
    adv = group_advantages([value] * 3 + [1.0, 0.0, 0.0], 3, eps=eps)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert torch.isfinite(adv).all()


def test_groups_are_independent_and_contiguous() -> None:
    adv = group_advantages([1, 0, 0, 0, 1, 1, 1, 0], 4)
    first = group_advantages([1, 0, 0, 0], 4)
    second = group_advantages([1, 1, 1, 0], 4)
    assert adv.tolist() == pytest.approx(first.tolist() + second.tolist())


def test_scale_none_only_centres_dr_grpo() -> None:
    assert group_advantages([1.0, 0.0, 0.0, 0.0], 4, scale="none").tolist() == pytest.approx(
        [0.75, -0.25, -0.25, -0.25]
    )


def test_scale_batch_divides_by_batch_std() -> None:
    rewards = [1.0, 0.0, 0.5, 0.5]
    batch_std = torch.tensor(rewards).std(correction=0).item()
    adv = group_advantages(rewards, 2, scale="batch")
    assert adv.tolist() == pytest.approx([0.5 / batch_std, -0.5 / batch_std, 0.0, 0.0], abs=1e-5)


def test_matches_a_plain_loop() -> None:
    rng = random.Random(0)
    for _ in range(50):
        g, n = rng.randint(1, 6), rng.randint(2, 8)
        rewards = [rng.choice([0.0, 1.0, rng.random()]) for _ in range(g * n)]
        got = group_advantages(rewards, n, ddof=1, eps=1e-4).tolist()
        want = []
        for i in range(g):
            grp = rewards[i * n : (i + 1) * n]
            mean = sum(grp) / n
            std = math.sqrt(sum((r - mean) ** 2 for r in grp) / (n - 1))
            want += [0.0 if max(grp) == min(grp) else (r - mean) / (std + 1e-4) for r in grp]
        assert got == pytest.approx(want, abs=1e-5)  # float32 arithmetic


@pytest.mark.parametrize(
    ("rewards", "size", "kwargs"),
    [([1.0, 0.0, 1.0], 2, {}), ([[1.0, 0.0]], 2, {}), ([1.0, 0.0], 2, {"scale": "std"}), ([1.0, 0.0], 1, {"ddof": 1})],
)
def test_rejects_bad_input(rewards: list, size: int, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        group_advantages(rewards, size, **kwargs)


def test_token_logprobs_use_the_temperature_scaled_distribution() -> None:
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    for t in (0.5, 1.0, 2.0):
        got = token_logprobs(logits, torch.tensor([0]), t)
        want = torch.log_softmax(logits / t, dim=-1)[0, 0]
        assert got.item() == pytest.approx(want.item())
    # Lower temperature sharpens: the top token's log-prob rises towards 0.
    assert token_logprobs(logits, torch.tensor([0]), 0.5) > token_logprobs(logits, torch.tensor([0]), 2.0)


def test_the_design_documents_import_path_is_the_same_function() -> None:
    """DESIGN names ``common.grpo.group_advantages`` as the public import: it is the very function, not a copy."""
    import common.grpo as grpo
    import common.grpo.advantages as advantages
    import common.grpo.logprobs as logprobs

    assert grpo.group_advantages is advantages.group_advantages
    assert grpo.token_logprobs is logprobs.token_logprobs
    # population std 0.5 and eps 1e-6 in the denominator: ±0.5 / (0.5 + 1e-6)
    assert grpo.group_advantages([1.0, 0.0, 1.0, 0.0], 4).tolist() == pytest.approx([1, -1, 1, -1], abs=1e-5)
