"""How versions reach an actor's engine, each way a :class:`WeightsSource`: announced on the shared volume and loaded
between rounds (:mod:`actor.weights.disk`), or broadcast over NCCL to the engines that take part in an update group
(:mod:`actor.weights.nccl`); with in-flight updates the disk's versions also load mid-round
(:mod:`actor.weights.mid_round`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class WeightsSource(Protocol):
    def poll(self, waiting: Callable[[], None]) -> bool:
        """Between rounds: load the version this source has for the engine now, if any (``waiting()`` is called
        while it waits: heartbeats). True when the engine took one."""
        ...
