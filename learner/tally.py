"""What a learner step measures as it trains (no I/O): the sums over its updates, and what the policy shows on the
tokens it is scored on. Under torchrun each rank sums its own slices, and ``reduce`` adds the ranks' sums."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from learner.batch import Batch
from learner.distributed import Ranks


@dataclass
class UpdateTally:
    """Sums over a step's updates: the loss's token-weighted metrics and their tokens, and the loss and gradient norm
    of the updates applied (a skipped one's are not finite and moved nothing)."""

    lr: float  # the rate the step's last applied update used
    weighted: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    tokens: float = 0.0
    loss: float = 0.0
    grad_norm: float = 0.0
    n_applied: int = 0
    skipped: float = 0.0
    # The forwards' positions (rows × each micro-batch's longest row) and the real tokens among them.
    positions: float = 0.0
    real: float = 0.0

    def forwarded(self, positions: int, real: int) -> None:
        self.positions += positions
        self.real += real

    def add(self, metrics: dict[str, float], tokens: float) -> None:
        for k, v in metrics.items():
            self.weighted[k] += v * tokens
        self.tokens += tokens

    def applied(self, loss: float, grad_norm: float, lr: float) -> None:
        self.loss += loss
        self.grad_norm += grad_norm
        self.n_applied += 1
        self.lr = lr

    def reduce(self, ranks: Ranks) -> None:
        """The ranks' sums: token-weighted metrics, tokens, the loss's parts. (They agree on which updates were
        applied: the gradient norm is the whole model's.)"""
        keys = sorted(self.weighted)
        total = ranks.sum([self.weighted[k] for k in keys] + [self.tokens, self.loss, self.positions, self.real])
        self.weighted = defaultdict(float, zip(keys, total[: len(keys)], strict=True))
        self.tokens, self.loss, self.positions, self.real = total[-4:]

    def stats(self) -> dict[str, float]:
        stats = {k: v / max(self.tokens, 1.0) for k, v in self.weighted.items()}
        n = self.n_applied
        stats |= {"loss": self.loss / n if n else math.nan, "grad_norm": self.grad_norm / n if n else math.nan}
        if self.positions:  # the share of the training forwards spent on padding
            stats["padding_frac"] = 1.0 - self.real / self.positions
        return stats | {"updates_skipped_nonfinite": self.skipped, "lr": self.lr}


class PolicyStats:
    """What the policy shows over the completion tokens it is scored on: its mean entropy, and the mean
    |learner − engine| log-prob where both are the same policy version (tokens with staleness 0), which measures the
    engine's numerical mismatch alone (absent when no such group was seen)."""

    def __init__(self) -> None:
        self.entropy = 0.0
        self.tokens = 0.0
        self.mismatch = 0.0
        self.fresh_tokens = 0.0
        self.slices = 0  # how many slices of rows it was given (every rank gives its own, empty or not)

    @torch.no_grad()
    def add(self, logp_all: torch.Tensor, logprobs: torch.Tensor, batch: Batch, mask: torch.Tensor, rows: torch.Tensor):
        """``logp_all``: every token's log-prob at the sampling temperature (common.grpo.logprobs.scaled_log_softmax),
        as the trainer computed it for the loss; ``logprobs``: the sampled tokens'."""
        self.slices += 1
        m = mask[rows]
        # logp_all covers the forward's positions (cut to the rows' longest); beyond them the mask is 0.
        self.entropy += float((-(logp_all.exp() * logp_all).sum(-1) * m[:, : logp_all.shape[1]]).sum())
        self.tokens += float(m.sum())
        fresh = m * (batch.token_staleness[rows] == 0).to(m.dtype)
        self.mismatch += float(((logprobs - batch.behavior_logprobs[rows]).abs() * fresh).sum())
        self.fresh_tokens += float(fresh.sum())

    def reduce(self, ranks: Ranks) -> None:
        self.entropy, self.tokens, self.mismatch, self.fresh_tokens = ranks.sum(
            [self.entropy, self.tokens, self.mismatch, self.fresh_tokens]
        )

    def stats(self) -> dict[str, float]:
        out = {"entropy": self.entropy / max(self.tokens, 1.0)}
        if self.fresh_tokens:
            out["mismatch/logprob_abs_mean"] = self.mismatch / self.fresh_tokens
        return out
