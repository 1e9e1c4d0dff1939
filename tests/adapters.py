"""A LoRA adapter that visibly changes a model, for the tests of learner.lora: a fresh adapter's B is 0 (it computes
the base exactly), so B is drawn here; peft draws A from torch's global generator, so two calls with one seed give
two adapters: publish and compare with the same object."""

from __future__ import annotations

import copy
from typing import Any

import torch

from common.model.lora import peft_config, wrap


def adapted(
    base: Any, rank: int = 4, seed: int = 0, alpha: float = 8.0, targets: list[str] | str = "all-linear"
) -> Any:
    """A copy of ``base`` with an adapter whose B is random (N(0, 0.05²)), in eval mode."""
    pm = wrap(copy.deepcopy(base), peft_config(rank, alpha, 0.0, targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return pm.eval()
