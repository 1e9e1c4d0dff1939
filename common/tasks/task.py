"""What a task is, whatever its source: :class:`Problem` (a prompt and the reference the grader gets) and
:class:`Task` (the training prompts, walked by the shared cursor, and the held-out problems)."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    id: str
    prompt: str
    reference: str


class Task:
    def __init__(self, name: str, train: list[Problem], eval: list[Problem], seed: int):
        self.name = name
        self.train = train
        self.eval = eval
        self._seed = seed
        self._passes: dict[int, list[int]] = {}

    @property
    def all(self) -> list[Problem]:
        return self.train + self.eval

    def at(self, position: int) -> Problem:
        """The training prompt at a cursor position: position p is element ``p mod n`` of the ``p div n``-th pass over
        the training prompts, each pass shuffled by the run's seed, so every replica computes the same order and no
        prompt is repeated within a pass however many actors there are."""
        n = len(self.train)
        epoch, i = divmod(position, n)
        order = self._passes.get(epoch)
        if order is None:
            order = list(range(n))
            random.Random(f"{self._seed}:{epoch}").shuffle(order)
            self._passes = {epoch: order}  # positions only move forward: keep the current pass only
        return self.train[order[i]]
