"""What the updates of a step train on (:class:`UpdateInputs`), and the proximal log-probs taken from the training
forward itself when a batch gets one update (:class:`FusedProximal`: one pass fewer than scoring it first)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from learner.batch import Batch
from learner.distributed import Ranks
from learner.loss import importance_weights
from learner.tally import PolicyStats


@dataclass(frozen=True)
class UpdateInputs:
    """What every update of a step trains on. ``old`` None: proximal log-probs come from the training forward."""

    batch: Batch
    mask: torch.Tensor
    adv: torch.Tensor
    old: torch.Tensor | None
    is_weights: torch.Tensor | None
    ref: torch.Tensor | None


class FusedProximal:
    """Proximal log-probs gathered from the training forward (one update per batch): each micro-batch's own, detached,
    with their importance weights; at the end, the same statistics the scoring pass reports."""

    def __init__(self, mask: torch.Tensor, shown: PolicyStats, lc: Any):
        self.mask = mask
        self.prox = torch.zeros_like(mask)
        self.shown = shown
        self.cap, self.mode = lc.tis_cap, lc.is_mode

    def add(
        self, logp_all: torch.Tensor, logprobs: torch.Tensor, batch: Batch, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.mask[rows]
        prox = logprobs * m
        self.prox[rows] = prox
        self.shown.add(logp_all, logprobs, batch, self.mask, rows)
        weights, _ = importance_weights(prox, batch.behavior_logprobs[rows], m, cap=self.cap, mode=self.mode)
        return prox, weights

    def finish(self, batch: Batch, ranks: Ranks | None) -> dict[str, float]:
        prox = self.prox
        if ranks is not None:
            prox = ranks.sum_tensor(prox)
            self.shown.reduce(ranks)
        _, w_stats = importance_weights(prox, batch.behavior_logprobs, self.mask, cap=self.cap, mode=self.mode)
        return self.shown.stats() | w_stats
