"""``actor.weight_updates: in_flight``: the actor's side of loading a version while its rounds are being sampled.

An engine asks :meth:`InFlightUpdates.due` between two decode steps (the local and sim engines) or the actor asks it
while it waits for its rounds (SGLang's): cheap, it reads the announcement from Redis only when the ``weights``
channel woke the actor or a second has passed. :meth:`InFlightUpdates.load` loads it through the actor's own load
path (verified, counted, logged; a refused version is tried again between rounds, with the actor's backoff), at
most once per announcement within a round, so that a version that cannot be loaded does not stop every step.

:class:`Backoff` is how often the actor tries a version that failed to load again, whenever it loads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from actor.engines.base import Engine
from actor.rounds import sampled_aside
from common.config import Config
from common.schemas import WeightsAnnouncement


@dataclass
class Backoff:
    """A failed load of one announcement is tried again at the next round (a refusal may be passing), then after
    ``first``, 2 × ``first`` … up to ``most`` seconds, not every round; another announcement (a newer version) is
    tried at once. Pure: the caller passes the clock."""

    first: float = 1.0
    most: float = 60.0
    key: Any = None
    attempts: int = 0
    until: float = 0.0

    def waiting(self, key: Any, now: float) -> bool:
        return key == self.key and now < self.until

    def failed(self, key: Any, now: float) -> float:
        """Record a failure of ``key`` at ``now``; returns the seconds until it may be tried again."""
        self.attempts = self.attempts + 1 if key == self.key else 1
        delay = 0.0 if self.attempts == 1 else min(self.most, self.first * 2 ** (self.attempts - 2))
        self.key, self.until = key, now + delay
        return delay


def announcement_key(ann: WeightsAnnouncement) -> tuple[int, str, str]:
    """What tells one announcement's weights from another's (a version republished elsewhere or altered is new)."""
    return ann.version, ann.uri, ann.digest


class InFlightUpdates:
    def __init__(
        self,
        newer: Callable[[], WeightsAnnouncement | None],
        load: Callable[[WeightsAnnouncement], object],
        woken: Callable[[], bool],
        every_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        *,
        midway: Callable[[WeightsAnnouncement], bool] = lambda ann: True,
    ):
        self.newer = newer  # the announcement to load, or None (the actor's rules: format, backoff)
        self.midway = midway  # whether it may be loaded mid-round (else it waits for the round's end)
        self._load = load
        self.woken = woken  # whether a weights announcement arrived since it was last asked
        self.every_s = every_s
        self.clock = clock
        self._next_read = 0.0
        self._due: WeightsAnnouncement | None = None
        self._tried: set[tuple[int, str, str]] = set()  # within this round
        self.loads = 0  # versions loaded mid-round

    def due(self) -> bool:
        if self._due is None and (self.woken() or self.clock() >= self._next_read):
            self._next_read = self.clock() + self.every_s
            ann = self.newer()
            if ann is not None and announcement_key(ann) not in self._tried and self.midway(ann):
                self._due = ann
        return self._due is not None

    def load(self) -> None:
        ann, self._due = self._due, None
        if ann is None:
            return
        self._tried.add(announcement_key(ann))
        if self._load(ann):
            self.loads += 1

    def new_round(self) -> None:
        """A new round: versions refused in the last one may be tried again (the actor's backoff still applies)."""
        self._tried.clear()


def same_lineage(epochs: Mapping[int, int], held: int, ann: WeightsAnnouncement) -> bool:
    """Whether ``ann`` was published by the learner lineage (epoch) that published the version held, or that one's is
    not known. A restarted learner's versions never meet a dead branch's in one answer: the learner ages tokens by
    version number within the answer's epoch, so they are loaded between rounds, with none in flight."""
    return epochs.get(held, ann.epoch) == ann.epoch


def in_flight_updates(
    cfg: Config,
    engine: Engine,
    newer: Callable[[], WeightsAnnouncement | None],
    load: Callable[[WeightsAnnouncement], object],
    woken: Callable[[], bool],
    midway: Callable[[WeightsAnnouncement], bool],
) -> InFlightUpdates | None:
    """The actor's in-flight updates where ``actor.weight_updates`` asks for them: handed to an engine that samples
    in the actor's thread (local, sim: it asks between two decode steps); for one that samples in other threads
    (SGLang's rounds) the actor asks while it waits for them."""
    if cfg.actor.weight_updates != "in_flight":
        return None
    updates = InFlightUpdates(newer, load, woken, midway=midway)
    if engine.capabilities.loads_mid_round and not sampled_aside(cfg, engine):
        engine.updates = updates
    return updates
