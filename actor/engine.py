"""Generation engines. Every engine returns, per prompt, ``group_size`` :class:`common.generation.Sample` s
(token ids, behaviour log-probs at the sampling temperature, finish reason) and can load a published version.

``local``: transformers on this process's CPU or GPU (the embedded default). The ``sglang`` engine (a client of a
SGLang server) returns the same type.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from common.config import Config
from common.generation import Sample, generate, pad_token_id, stop_token_ids
from common.models import load_pretrained
from common.schemas import WeightsAnnouncement
from common.weights import load_into, load_state_dict

log = logging.getLogger(__name__)


class Engine(Protocol):
    version: int
    tokenizer: Any

    def generate(self, prompts: Sequence[Sequence[int]], n: int) -> list[list[Sample]]: ...

    def load(self, ann: WeightsAnnouncement) -> int:
        """Load a published version; returns the bytes read."""
        ...


class LocalEngine:
    def __init__(self, cfg: Config, seed: int):
        self.cfg = cfg
        self.tokenizer, self.model = load_pretrained(cfg.model.path, cfg.model.dtype, cfg.model.device)
        self.stop_ids = stop_token_ids(self.model, self.tokenizer)
        self.pad_id = pad_token_id(self.tokenizer, self.stop_ids)
        self.version = 0
        torch.manual_seed(seed)

    def generate(self, prompts: Sequence[Sequence[int]], n: int) -> list[list[Sample]]:
        s = self.cfg.sampling
        return generate(
            self.model,
            prompts,
            n=n,
            max_new_tokens=s.max_new_tokens,
            stop_ids=self.stop_ids,
            pad_id=self.pad_id,
            temperature=s.temperature,
        )

    def load(self, ann: WeightsAnnouncement) -> int:
        state, nbytes = load_state_dict(ann)
        load_into(self.model, state)
        self.version = ann.version
        return nbytes


def make_engine(cfg: Config, seed: int) -> Engine:
    if cfg.actor.engine == "local":
        return LocalEngine(cfg, seed)
    raise ValueError(f"unknown engine {cfg.actor.engine!r}")
