"""What every generation engine is, and what it can do.

An engine samples: per prompt, ``n`` :class:`common.rollout.Sample` s (token ids, behaviour log-probs at the sampling
temperature, finish reason), and the policy version it sampled them with; it loads a published version; it says when
the server it depends on has failed (:class:`EngineError`). What it can do beyond that is its :class:`Capabilities`,
fixed when it starts, which the actor reads instead of probing the engine: whether it batches concurrent requests (and
so keeps rounds in flight), whether it stamps each token with its version, whether it takes a version between two
decode steps itself, how many ranks it takes in an NCCL update group (and so implements :class:`NcclEngine`).

The engines (:mod:`actor.engines.local`, :mod:`actor.engines.sim`, :mod:`actor.engines.sglang.engine`) import this
and not each other; :func:`actor.engines.make_engine` gives the configured one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from common.rollout import Sample
from common.schemas import NcclRound, WeightsAnnouncement


class EngineError(RuntimeError):
    """The engine's server is unreachable or answered something the actor cannot use."""


class BetweenRounds(Exception):
    """Raised by an engine's ``load`` called mid-round for a version it can take only between rounds (one that
    replaces the model object, such as the first LoRA adapter): nothing was loaded, and the actor loads it before
    its next round instead, without counting a failure."""


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, fixed when it starts.

    - ``concurrent_requests``: it batches requests sent from several threads at once (a SGLang server's continuous
      batching), so an actor keeps ``rounds_in_flight`` rounds generating, and with in-flight updates loads versions
      while it waits for them (actor.rounds);
    - ``rounds_in_flight``: how many, where it batches (``sglang.rounds_in_flight``, ``actor.sim_rounds_in_flight``);
    - ``loads_mid_round``: it asks its ``updates`` between two decode steps and loads a version there itself (an
      engine in this process);
    - ``nccl_ranks``: the ranks its side of an NCCL update group takes (a SGLang server's tensor-parallel size; 1 for
      the local engine); 0, none: it implements no :class:`NcclEngine` and loads every version from disk.
    """

    concurrent_requests: bool = False
    rounds_in_flight: int = 1
    loads_mid_round: bool = False
    nccl_ranks: int = 0


class Updates(Protocol):
    """``actor.weight_updates: in_flight``: what an engine asks while a round is being sampled (the actor's side,
    actor.weights.mid_round). Called from the thread that samples (an engine that loads mid-round) or that waits for
    the samples (SGLang's rounds), never from two at once."""

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


class Engine(Protocol):
    version: int  # the policy version it serves; -1 while it holds weights nobody announced (actor.weights.nccl)
    tokenizer: Any
    stop_ids: set[int]  # a completion (or an episode's turn) ends at any of these; an environment adds its own
    capabilities: Capabilities
    # With in-flight updates, an engine that loads mid-round asks these between two decode steps (set by the actor).
    updates: Updates | None

    def generate(self, prompts: Sequence[Sequence[int]], n: int, *, greedy: bool = False) -> list[list[Sample]]:
        """``n`` samples per prompt at ``sampling.temperature``; ``greedy`` for the likeliest answer (evaluation)."""
        ...

    def generate_versioned(
        self, prompts: Sequence[Sequence[int]], n: int, *, greedy: bool = False
    ) -> tuple[list[list[Sample]], int | None]:
        """The samples and the policy version the engine generated them with, where it knows better than the version
        it held when asked (a server reports the version each reply came from); None where it does not."""
        ...

    def load(self, ann: WeightsAnnouncement) -> int:
        """Load a published version; returns the bytes read."""
        ...

    def failed(self) -> str | None:
        """Why the server this engine depends on is gone (a launched one died), or None: asked while the actor waits,
        so that a dead server ends the actor then, not at its next request."""
        ...

    def close(self) -> None:
        """Release what the engine started (a server it launched)."""
        ...


class NcclEngine(Engine, Protocol):
    """An engine with ``capabilities.nccl_ranks`` > 0: it takes weights over NCCL (``weights.transport: nccl``;
    actor.weights.nccl is the actor's side of the protocol, common.weights.nccl what both sides agree on)."""

    def join_group(self, nccl_round: NcclRound, rank_offset: int, timeout_s: float) -> None: ...

    def leave_group(self, group: str) -> None: ...

    def receive(self, nccl_round: NcclRound, timeout_s: float) -> int:
        """Take the round's buckets (the learner is broadcasting them now), not yet in service; returns the bytes
        received. Raises WeightsError when the engine kept its weights and can go on, EngineError when not."""
        ...

    def commit(self, nccl_round: NcclRound) -> None:
        """The round's version was announced: it is the engine's version from now on."""
        ...

    def discard(self, nccl_round: NcclRound) -> None:
        """The round's version was never announced: what arrived is not served (the engine keeps the version it had,
        or, where it could not keep the old weights, samples nothing until it loads a whole announced one)."""
        ...
