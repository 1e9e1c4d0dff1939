"""Prompt sources. The demo task is single-digit addition: ``"3+5="`` → ``"8"``.

All 100 problems are split once, by ``run.seed``, into a held-out evaluation set (``task.eval_size``) and the RL
training prompts. Actors walk the training prompts through the shared cursor in Redis: position p is element
``p mod n`` of the ``p div n``-th shuffled pass, so every replica computes the same order and no prompt is repeated
within a pass however many actors there are.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    id: str
    prompt: str
    reference: str


class AdditionTask:
    def __init__(self, eval_size: int = 20, seed: int = 0):
        problems = [Problem(f"add-{a}-{b}", f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]
        if not 1 <= eval_size < len(problems):
            raise ValueError(f"task.eval_size must be in [1, {len(problems) - 1}], got {eval_size}")
        random.Random(seed).shuffle(problems)
        self.eval = problems[:eval_size]
        self.train = problems[eval_size:]
        self._seed = seed
        self._passes: dict[int, list[int]] = {}

    @property
    def all(self) -> list[Problem]:
        return self.train + self.eval

    def at(self, position: int) -> Problem:
        """The training prompt at a cursor position (see the module docstring)."""
        n = len(self.train)
        epoch, i = divmod(position, n)
        order = self._passes.get(epoch)
        if order is None:
            order = list(range(n))
            random.Random(f"{self._seed}:{epoch}").shuffle(order)
            self._passes = {epoch: order}  # positions only move forward: keep the current pass only
        return self.train[order[i]]


def make_task(name: str, eval_size: int, seed: int) -> AdditionTask:
    if name == "addition":
        return AdditionTask(eval_size=eval_size, seed=seed)
    raise ValueError(f"unknown task {name!r}")
