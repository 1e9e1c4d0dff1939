"""The log-prob of a sampled token, as engines report it and the learner must score it."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities of ``tokens`` under ``softmax(logits / temperature)``, computed in fp32.

    ``logits`` (..., V) and ``tokens`` (...). This is the distribution an engine samples from at that temperature and
    the one SGLang reports (over the full vocabulary): learner and actor must use the same one, or the importance
    ratio starts away from 1.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1).long()).squeeze(-1)
