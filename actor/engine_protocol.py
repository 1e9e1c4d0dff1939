"""What every generation engine is: per prompt, ``n`` :class:`common.model.generation.Sample` s (token ids, behaviour
log-probs at the sampling temperature, finish reason), a version it can load, and :class:`EngineError` when its
server fails. The engines (:mod:`actor.engine`, :mod:`actor.sglang_engine`) import this and not each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from common.model.generation import Sample
from common.schemas import WeightsAnnouncement


class EngineError(RuntimeError):
    """The engine's server is unreachable or answered something the actor cannot use."""


class Engine(Protocol):
    version: int
    tokenizer: Any

    def generate(self, prompts: Sequence[Sequence[int]], n: int, *, greedy: bool = False) -> list[list[Sample]]:
        """``n`` samples per prompt at ``sampling.temperature``; ``greedy`` for the likeliest answer (evaluation)."""
        ...

    def load(self, ann: WeightsAnnouncement) -> int:
        """Load a published version; returns the bytes read."""
        ...

    def close(self) -> None:
        """Release what the engine started (a server it launched)."""
        ...
