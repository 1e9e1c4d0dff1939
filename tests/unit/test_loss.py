"""learner.loss.grpo_loss: hand-computed values, clipping on both sides, and a plain per-token loop."""

from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch

from learner.loss import LOSS_TYPES, grpo_loss, micro_batch_weight


def _case() -> dict[str, torch.Tensor]:
    """Two completions. A (advantage +1): ratios 1.0, 1.5. B (advantage −1): ratios 0.5, 1.0, 1.0.
    With ε_low 0.2 / ε_high 0.28 the per-token losses are −1, −1.28 (clipped high) and 0.8 (clipped low), 1, 1."""
    ratios = torch.tensor([[1.0, 1.5, 1.0], [0.5, 1.0, 1.0]], dtype=torch.float64)
    return {
        "logprobs": torch.log(ratios).requires_grad_(),
        "old_logprobs": torch.zeros(2, 3, dtype=torch.float64),
        "advantages": torch.tensor([1.0, -1.0], dtype=torch.float64),
        "mask": torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float64),
    }


@pytest.mark.parametrize(
    ("loss_type", "kwargs", "expected"),
    [
        ("dapo", {}, (-1 - 1.28 + 0.8 + 1 + 1) / 5),
        ("bnpo", {}, (-1 - 1.28 + 0.8 + 1 + 1) / 5),
        ("grpo", {}, ((-1 - 1.28) / 2 + (0.8 + 1 + 1) / 3) / 2),
        ("dr_grpo", {"max_completion_length": 4}, (-1 - 1.28 + 0.8 + 1 + 1) / (2 * 4)),
        ("dapo", {"num_tokens": 10}, (-1 - 1.28 + 0.8 + 1 + 1) / 10),
    ],
)
def test_hand_computed_losses(loss_type: str, kwargs: dict, expected: float) -> None:
    loss, _ = grpo_loss(**_case(), loss_type=loss_type, **kwargs)
    assert loss.item() == pytest.approx(expected, abs=1e-9)


def test_clip_metrics_on_both_sides() -> None:
    _, m = grpo_loss(**_case())
    assert m["clip_ratio/low_mean"] == pytest.approx(1 / 5)  # B's ratio 0.5 < 0.8 with A < 0
    assert m["clip_ratio/high_mean"] == pytest.approx(1 / 5)  # A's ratio 1.5 > 1.28 with A > 0
    assert m["clip_ratio/region_mean"] == pytest.approx(2 / 5)
    assert "kl" not in m


def test_clipped_tokens_get_no_gradient() -> None:
    case = _case()
    loss, _ = grpo_loss(**case)
    loss.backward()
    grad = case["logprobs"].grad
    assert grad[0, 1].item() == 0.0 and grad[1, 0].item() == 0.0  # the two clipped tokens
    # Unclipped: d(−r·A/N)/d logp = −r·A/N with N = 5 tokens.
    assert grad[0, 0].item() == pytest.approx(-1 / 5)
    assert grad[1, 1].item() == pytest.approx(1 / 5)
    assert grad[0, 2].item() == 0.0  # masked


def test_importance_weights_multiply_the_policy_loss() -> None:
    w = torch.tensor([[2.0, 1.0, 1.0], [1.0, 1.0, 0.5]], dtype=torch.float64)
    loss, _ = grpo_loss(**_case(), is_weights=w)
    assert loss.item() == pytest.approx((-2 - 1.28 + 0.8 + 1 + 0.5) / 5)


def test_k3_kl_is_added_per_token_after_the_weights() -> None:
    case = _case()
    ref = case["logprobs"].detach() + torch.tensor([[0.5, 0.0, 0.0], [0.0, -0.3, 0.0]], dtype=torch.float64)
    w = torch.full((2, 3), 0.5, dtype=torch.float64)
    loss, m = grpo_loss(**case, beta=0.1, ref_logprobs=ref, is_weights=w)
    k3 = lambda d: math.exp(d) - d - 1  # noqa: E731
    kl_sum = k3(0.5) + k3(-0.3)
    assert m["kl"] == pytest.approx(kl_sum / 5)
    assert loss.item() == pytest.approx((0.5 * (-1 - 1.28 + 0.8 + 1 + 1) + 0.1 * kl_sum) / 5)


def test_rejects_unknown_type_and_missing_reference() -> None:
    with pytest.raises(ValueError):
        grpo_loss(**_case(), loss_type="ppo")
    with pytest.raises(ValueError):
        grpo_loss(**_case(), beta=0.04)


def test_dapo_accumulation_equals_one_big_batch() -> None:
    """Two micro-batches with the step's token count give exactly the gradient of the whole batch."""
    torch.manual_seed(0)
    b, t = 6, 5
    base = torch.randn(b, t, dtype=torch.float64) * 0.1
    old = torch.randn(b, t, dtype=torch.float64) * 0.1
    adv = torch.randn(b, dtype=torch.float64)
    mask = (torch.rand(b, t) > 0.3).double()
    whole = base.clone().requires_grad_()
    grpo_loss(whole, old, adv, mask)[0].backward()
    parts = base.clone().requires_grad_()
    n = mask.sum()
    for rows in (slice(0, 2), slice(2, 6)):
        grpo_loss(parts[rows], old[rows], adv[rows], mask[rows], num_tokens=n)[0].backward()
    assert torch.allclose(whole.grad, parts.grad, atol=1e-12)


def _reference_loop(lp, old, adv, mask, loss_type, el, eh, beta, ref, lmax, w, num_tokens=None):  # type: ignore[no-untyped-def]
    """The objective written token by token, straight from the formulas in learner/loss.py's docstring."""
    b, t = lp.shape
    per_seq, total, count = [], 0.0, 0.0
    for i in range(b):
        seq, n = 0.0, 0.0
        for j in range(t):
            if mask[i, j] == 0:
                continue
            r = torch.exp(lp[i, j] - old[i, j])
            term = -torch.min(r * adv[i], torch.clamp(r, 1 - el, 1 + eh) * adv[i])
            if w is not None:
                term = term * w[i, j]
            if beta > 0:
                d = ref[i, j] - lp[i, j]
                term = term + beta * (torch.exp(d) - d - 1)
            seq, n = seq + term, n + 1
        per_seq.append(seq / max(n, 1.0))
        total, count = total + seq, count + n
    if loss_type == "grpo":
        return sum(per_seq) / b
    if loss_type == "dr_grpo":
        return total / (b * lmax)
    if loss_type == "dapo" and num_tokens is not None:
        return total / num_tokens
    return total / max(count, 1.0)


@pytest.mark.parametrize(
    ("loss_type", "beta", "weighted", "eps", "given_tokens"),
    itertools.product(LOSS_TYPES, [0.0, 0.04], [False, True], [(0.2, 0.28), (0.1, 0.1)], [False, True]),
)
def test_matches_a_plain_loop_with_gradients(
    loss_type: str, beta: float, weighted: bool, eps: tuple[float, float], given_tokens: bool
) -> None:
    """Every combination of options, on random ragged batches (empty rows included), loss and gradients to 1e-6."""
    el, eh = eps
    gen = torch.Generator().manual_seed(zlib.crc32(f"{loss_type}-{beta}-{weighted}-{eps}-{given_tokens}".encode()))
    for _ in range(3):
        b, t = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 7, (1,), generator=gen))
        lengths = torch.randint(0, t + 1, (b,), generator=gen)
        mask = (torch.arange(t)[None, :] < lengths[:, None]).double()
        base = torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.4 - 1
        old = base + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.3  # ratios on both sides of the clip
        ref = base + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.2
        adv = torch.randn(b, generator=gen, dtype=torch.float64)
        w = torch.rand(b, t, generator=gen, dtype=torch.float64) * 2 if weighted else None
        # A step's token count larger than this micro-batch's, as under gradient accumulation.
        n_tokens = float(mask.sum()) + 7 if given_tokens else None
        kw = dict(loss_type=loss_type, epsilon_low=el, epsilon_high=eh, beta=beta, max_completion_length=t)
        a = base.clone().requires_grad_()
        got, _ = grpo_loss(
            a, old, adv, mask, ref_logprobs=ref if beta else None, is_weights=w, num_tokens=n_tokens, **kw
        )
        got.backward()
        bb = base.clone().requires_grad_()
        want = _reference_loop(bb, old, adv, mask, loss_type, el, eh, beta, ref, t, w, n_tokens)
        if isinstance(want, torch.Tensor) and want.requires_grad:
            want.backward()
            assert torch.allclose(a.grad, bb.grad, atol=1e-6)
        else:
            assert float(a.grad.abs().sum()) == 0.0
        want_value = want.item() if isinstance(want, torch.Tensor) else float(want)
        assert got.item() == pytest.approx(want_value, abs=1e-6)


def test_masked_positions_cannot_overflow_into_nan() -> None:
    """Prompt and pad positions may hold any log-prob; masked out, they must not turn the loss or its gradient NaN."""
    logprobs = torch.tensor([[-300.0, -0.5, -0.7]], requires_grad=True)
    old = torch.tensor([[0.0, -0.6, -0.7]])
    ref = torch.tensor([[0.0, -0.4, -0.7]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    loss, m = grpo_loss(logprobs, old, torch.tensor([1.0]), mask, beta=0.04, ref_logprobs=ref)
    loss.backward()
    assert torch.isfinite(loss) and math.isfinite(m["kl"]) and torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0, 0].item() == 0.0


def test_the_loss_table_lists_the_configs_loss_types() -> None:
    from typing import get_args

    from common.config import LearnerConfig

    assert list(LOSS_TYPES) == list(get_args(LearnerConfig.model_fields["loss_type"].annotation))


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_weighted_micro_batch_losses_add_up_to_the_whole_mini_batchs(loss_type: str) -> None:
    """Micro-batches of unequal sizes, each split over two "ranks": the weighted parts sum to one big mini-batch's
    loss (bnpo's token mean is per micro-batch by definition, so it has no such sum)."""
    gen = torch.Generator().manual_seed(7)
    b, t = 7, 5
    mask = (torch.arange(t)[None, :] < torch.tensor([5, 1, 3, 0, 4, 2, 5])[:, None]).double()
    logprobs = torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.3 - 1
    old = logprobs + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.2
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    kw = {"loss_type": loss_type, "max_completion_length": t, "num_tokens": mask.sum()}
    rows = torch.arange(b)
    whole, _ = grpo_loss(logprobs, old, adv, mask, **kw)
    parts = 0.0
    for micro in rows.tensor_split(3):
        for mine in micro.tensor_split(2):
            if len(mine) == 0:
                continue
            loss, _ = grpo_loss(logprobs[mine], old[mine], adv[mine], mask[mine], **kw)
            parts += float(loss) * micro_batch_weight(loss_type, mask, mine, micro, rows)
    assert parts == pytest.approx(float(whole), abs=1e-12)
