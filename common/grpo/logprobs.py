"""The log-prob of a sampled token, as engines report it and the learner must score it."""

from __future__ import annotations

import torch


def scaled_log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities of every token under ``softmax(logits / temperature)``, in fp32: the distribution an engine
    samples from at that temperature and the one SGLang reports (over the full vocabulary). Learner and actor must use
    the same one, or the importance ratio starts away from 1."""
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def gather_tokens(logp_all: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``logp_all`` (..., V) at ``tokens`` (...): the sampled tokens' log-probs."""
    return logp_all.gather(-1, tokens.unsqueeze(-1).long()).squeeze(-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probabilities of ``tokens`` under ``softmax(logits / temperature)``, computed in fp32 (``logits``
    (..., V), ``tokens`` (...)). The trainer, which also needs the full distribution for the entropy, calls the two
    halves itself so that it computes the log-softmax once."""
    return gather_tokens(scaled_log_softmax(logits, temperature), tokens)
