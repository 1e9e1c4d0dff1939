"""The GRPO policy loss, as a pure function of tensors.

Per token t of completion i (PPO's clipped surrogate, Schulman et al. 2017, with GRPO's group advantage A_i):

    r_it   = exp(logp_it − old_logp_it)                               # 1 at the start of a step
    L_it   = −min(r_it·A_i, clip(r_it, 1 − ε_low, 1 + ε_high)·A_i)     # ε_high > ε_low: DAPO's clip-higher
    L_it  ← w_it · L_it                                               # truncated importance weights (off-policy)
    L_it  ← L_it + β·(exp(ref_it − logp_it) − (ref_it − logp_it) − 1) # k3 KL estimator (DeepSeekMath), per token

and the per-token losses are aggregated by ``loss_type`` — the one place GRPO, Dr. GRPO and DAPO differ:

- ``grpo``   (DeepSeekMath): mean over each completion's tokens, then mean over completions. Every completion weighs
  the same, so a long wrong answer spreads its penalty thin (the length bias Dr. GRPO points out).
- ``bnpo``:  mean over all tokens of the micro-batch.
- ``dr_grpo`` (Liu et al., 2025): sum ÷ (B × max_completion_length), a constant, so no length bias.
- ``dapo``   (Yu et al., 2025): sum ÷ the token count of the whole optimizer step (``num_tokens``, summed across
  gradient-accumulation micro-batches), so each token weighs the same whatever micro-batch it sits in.

Under gradient accumulation (and FSDP's ranks) each micro-batch's loss is weighted so that the parts add up to one
big mini-batch's gradient (:func:`micro_batch_weight`); the aggregation and that weighting are one entry per loss type
in :data:`LOSS_TYPES`.

Metrics (token means over the mask): ``clip_ratio/low_mean`` (r < 1 − ε_low with A < 0: the clip stops a bad answer's
probability from falling further), ``clip_ratio/high_mean`` (r > 1 + ε_high with A > 0), ``clip_ratio/region_mean``
(either), and ``kl`` when β > 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def _grpo(per_token: torch.Tensor, mask: torch.Tensor, **_: object) -> torch.Tensor:
    # Each completion's own length is its divisor (clamped: an all-masked row contributes 0, not NaN).
    return ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()


def _bnpo(per_token: torch.Tensor, mask: torch.Tensor, **_: object) -> torch.Tensor:
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def _dr_grpo(per_token: torch.Tensor, mask: torch.Tensor, *, max_completion_length: int | None, **_: object):
    # A constant divisor: the gradient of a token does not depend on how long its answer or batch is.
    length = max_completion_length if max_completion_length is not None else mask.shape[1]
    return (per_token * mask).sum() / (mask.shape[0] * length)


def _dapo(per_token: torch.Tensor, mask: torch.Tensor, *, num_tokens: float | torch.Tensor | None, **_: object):
    # The optimizer step's token count, not this micro-batch's: accumulating k micro-batches must give the same
    # gradient as one big batch, which a per-micro-batch mean would not when their token counts differ.
    total = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=per_token.dtype)
    return (per_token * mask).sum() / total.clamp(min=1.0)


def _row_share(mask: torch.Tensor, part: torch.Tensor, whole: torch.Tensor) -> float:
    return len(part) / len(whole)


def _token_share(mask: torch.Tensor, part: torch.Tensor, whole: torch.Tensor) -> float:
    return float(mask[part].sum()) / max(float(mask[whole].sum()), 1.0)


@dataclass(frozen=True)
class LossType:
    """One loss type: how it aggregates a micro-batch's per-token losses, and what share of a micro-batch a part of
    its rows is (``None``: the aggregate divides by the whole optimizer step already; see :func:`micro_batch_weight`).
    """

    aggregate: Callable[..., torch.Tensor]
    share: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], float] | None


# The one table of loss types; common.config's LearnerConfig.loss_type lists the same names (a test ties them).
LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType(_grpo, _row_share),
    # bnpo's token mean is per micro-batch by definition: a rank's slice weighs by its tokens.
    "bnpo": LossType(_bnpo, _token_share),
    "dr_grpo": LossType(_dr_grpo, _row_share),
    "dapo": LossType(_dapo, None),
}


def micro_batch_weight(
    loss_type: str, mask: torch.Tensor, mine: torch.Tensor, micro: torch.Tensor, rows: torch.Tensor
) -> float:
    """The factor on the loss of ``mine`` (this rank's rows of micro-batch ``micro``, of mini-batch ``rows``) that
    makes gradient accumulation, and FSDP's ranks, add up to one big mini-batch's gradient.

    ``dapo`` divides by the step's token count already (``num_tokens``): 1. The others are means over their
    micro-batch: each is weighted by its share of the mini-batch's rows, which makes ``grpo`` and ``dr_grpo`` equal to
    one big mini-batch (``bnpo``'s token mean stays per micro-batch, as its definition says); a rank's slice is
    weighted by its share of the micro-batch the same way, by rows, or by tokens for ``bnpo``."""
    share = LOSS_TYPES[loss_type].share
    if share is None:
        return 1.0
    return share(mask, mine, micro) * len(micro) / len(rows)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.28,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    is_weights: torch.Tensor | None = None,
    num_tokens: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Shapes: (B, T) for every tensor except ``advantages`` (B,). Returns ``(loss, metrics)``."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {tuple(LOSS_TYPES)}, not {loss_type!r}")
    if beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs")
    mask = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype).unsqueeze(1)

    ratio = torch.exp(torch.where(mask > 0, logprobs - old_logprobs, torch.zeros_like(logprobs)))
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv)
    per_token = -surrogate
    if is_weights is not None:
        per_token = per_token * is_weights  # before the KL term: the KL penalty is not an off-policy estimate
    kl = None
    if beta > 0:
        assert ref_logprobs is not None
        # Zero outside the mask before exp: a prompt or pad position the model finds very unlikely would otherwise
        # overflow to inf, and inf·0 is NaN in the loss and its gradient.
        delta = torch.where(mask > 0, ref_logprobs - logprobs, torch.zeros_like(logprobs))
        kl = torch.exp(delta) - delta - 1  # k3: unbiased, always >= 0
        per_token = per_token + beta * kl

    aggregate = LOSS_TYPES[loss_type].aggregate
    loss = aggregate(per_token, mask, max_completion_length=max_completion_length, num_tokens=num_tokens)

    return loss, _clip_metrics(ratio, adv, mask, epsilon_low, epsilon_high, kl)


@torch.no_grad()
def _clip_metrics(
    ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, eps_low: float, eps_high: float, kl: torch.Tensor | None
) -> dict[str, float]:
    """The share of masked tokens whose ratio the clip cut (below, where the advantage is negative; above, where it
    is positive; either), and the mean KL to the reference where there is one."""
    n = mask.sum().clamp(min=1.0)
    low = ((ratio < 1 - eps_low) & (adv < 0)).to(mask.dtype)
    high = ((ratio > 1 + eps_high) & (adv > 0)).to(mask.dtype)
    metrics = {
        "clip_ratio/low_mean": float((low * mask).sum() / n),
        "clip_ratio/high_mean": float((high * mask).sum() / n),
        "clip_ratio/region_mean": float((torch.clamp(low + high, max=1.0) * mask).sum() / n),
    }
    if kl is not None:
        metrics["kl"] = float((kl * mask).sum() / n)
    return metrics


def importance_weights(
    proximal: torch.Tensor,
    behavior: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
    mode: str = "truncate",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token weights correcting for tokens sampled by a stale behaviour policy (AReaL's decoupled PPO).

    With the proximal policy as the ratio's denominator, the surrogate's expectation is under π_prox while the tokens
    came from π_behaviour; each token's loss is therefore weighted by w = π_prox / π_behaviour, bounded by ``cap`` C:

    - ``truncate`` (truncated importance sampling, TIS): min(w, C) — high weights are cut, low ones kept;
    - ``mask``: w inside [1/C, C], 0 outside — tokens the two policies disagree about are dropped altogether.

    Metrics over the mask: ``is_weight/mean``, ``is_weight/max`` (after the cap), ``is_weight/truncated_frac`` (the
    fraction of tokens whose raw weight was cut or dropped).
    """
    if mode not in ("truncate", "mask"):
        raise ValueError(f"mode must be truncate or mask, not {mode!r}")
    # where, not a product with the mask: a behaviour log-prob outside it (an environment's token has none) must not
    # reach the exponential, and NaN × 0 is NaN.
    raw = torch.exp(torch.where(mask > 0, proximal - behavior, torch.zeros_like(proximal)))
    if mode == "truncate":
        weights = torch.clamp(raw, max=cap)
        cut = raw > cap
    else:
        cut = (raw > cap) | (raw < 1.0 / cap)
        weights = torch.where(cut, torch.zeros_like(raw), raw)
    weights = weights * mask
    with torch.no_grad():
        on = mask > 0
        n = on.sum().clamp(min=1)
        metrics = {
            "is_weight/mean": float(weights[on].sum() / n),
            "is_weight/max": float(weights[on].max()) if on.any() else 0.0,
            "is_weight/truncated_frac": float((cut & on).sum() / n),
        }
    return weights, metrics
