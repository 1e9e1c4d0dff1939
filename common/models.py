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
