"""What every generation engine is: per prompt, ``n`` :class:`common.model.generation.Sample` s (token ids, behaviour
log-probs at the sampling temperature, finish reason), a version it can load, and :class:`EngineError` when its
server fails. The engines (:mod:`actor.engine`, :mod:`actor.sglang_engine`) import this and not each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from common.rollout import Sample
from common.schemas import WeightsAnnouncement


class EngineError(RuntimeError):
    """The engine's server is unreachable or answered something the actor cannot use."""


class BetweenRounds(Exception):
    """Raised by an engine's ``load`` called mid-round for a version it can take only between rounds (one that
    replaces the model object, such as the first LoRA adapter): nothing was loaded, and the actor loads it before
    its next round instead, without counting a failure."""


class Engine(Protocol):
    version: int
    tokenizer: Any
    stop_ids: set[int]  # a completion (or an episode's turn) ends at any of these; an environment adds its own

    def generate(self, prompts: Sequence[Sequence[int]], n: int, *, greedy: bool = False) -> list[list[Sample]]:
        """``n`` samples per prompt at ``sampling.temperature``; ``greedy`` for the likeliest answer (evaluation)."""
        ...

    def load(self, ann: WeightsAnnouncement) -> int:
        """Load a published version; returns the bytes read."""
        ...

    def close(self) -> None:
        """Release what the engine started (a server it launched)."""
        ...


class Updates(Protocol):
    """``actor.weight_updates: in_flight``: what an engine asks while a round is being sampled (the actor's side,
    actor.updates). Called from the thread that samples (the local and sim engines) or that waits for the samples
    (SGLang's rounds), never from two at once."""

    def due(self) -> bool:
        """A newer version than the engine holds is announced and may be loaded now (cheap: asked at every decode
        step, it reads Redis only when woken or now and then)."""
        ...

    def load(self) -> None:
        """Load the announced version now (the engine's version changes, or stays where the load was refused: then
        it is not due again within this round)."""
        ...


def load_if_due(updates: Updates) -> None:
    if updates.due():
        updates.load()
