"""Loading a policy from an HF-format directory (or, on a machine with network access, a hub name)."""

from __future__ import annotations

from typing import Any

import torch


def load_pretrained(path: str, dtype: str, device: str) -> tuple[Any, Any]:
    """Tokenizer and causal LM, in eval mode on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return tokenizer, model.to(device).eval()


def max_positions(path: str) -> int | None:
    """The longest sequence the model takes (``max_position_embeddings`` of its config), None when it does not say."""
    from transformers import AutoConfig

    value = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
    return int(value) if value else None
