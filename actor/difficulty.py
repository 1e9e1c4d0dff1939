"""Difficulty-aware prompt sampling (``actor.prompt_sampling: difficulty``), as pure decisions.

A group whose rewards are all equal teaches nothing (DAPO filters it); a problem whose recent groups were all right
(or all wrong) will most likely give another such group. The run keeps, per training problem, its recent outcomes
(a *history*: one character per group, oldest first, at most ``actor.difficulty_window`` of them, shared by every
actor through Redis). An actor still walks the shared cursor, so no two actors draw the same problem within a pass;
at each position it *takes* the problem with its draw chance and *passes over* it otherwise, and claims positions
until it has its round:

- a problem never graded (no history) is always taken;
- otherwise the chance is the share of its recent groups that were informative (rewards not all equal), and never
  below ``actor.difficulty_floor``: a problem the model has solved (or cannot solve) is still retried now and then, so
  one it forgets, or starts to learn, comes back.

The decision at a position is a hash of the run's seed and the position (:func:`uniform`), the same in every process
and every restart: given the histories, which problems come next is a function of the seed alone. Passing over a
problem skips it for this pass only; the next pass draws it again.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.grpo.advantages import is_zero_std

INFORMATIVE, SOLVED, UNSOLVED = "m", "r", "w"  # one group's outcome: mixed rewards, all right, all wrong


def outcome(rewards: Sequence[float]) -> str:
    """A group's outcome, as its history records it, from its rewards as graded: informative when they differ;
    otherwise all right when they are above 0, all wrong when not."""
    if not is_zero_std(rewards):
        return INFORMATIVE
    return SOLVED if rewards[0] > 0 else UNSOLVED


def appended(history: str, new: str, window: int) -> str:
    """The history with a group's outcome added, keeping the newest ``window`` (as the Redis script does)."""
    return (history + new)[-window:]


def pool(history: str) -> str:
    """Which pool (common.schemas.PromptPool) a problem is in, by its history: unseen, informative (a recent group
    taught something), solved (all recent groups all right), unsolved (all all wrong), flipping (all right and all
    wrong by turns, never mixed)."""
    if not history:
        return "unseen"
    if INFORMATIVE in history:
        return "informative"
    if set(history) == {SOLVED}:
        return "solved"
    if set(history) == {UNSOLVED}:
        return "unsolved"
    return "flipping"


def draw_chance(history: str, floor: float) -> float:
    """The chance that the problem is taken when the cursor reaches it: 1 unseen, else the informative share of its
    history, at least ``floor``."""
    if not history:
        return 1.0
    return max(floor, history.count(INFORMATIVE) / len(history))


def uniform(seed: int, position: int) -> float:
    """A number in [0, 1) fixed by the seed and the cursor position (blake2b: Python's ``hash`` differs between
    processes)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@dataclass
class Draw:
    """Which candidates a round takes and which it passes over (indices into the candidates), and their pools."""

    taken: list[int] = field(default_factory=list)
    passed: list[int] = field(default_factory=list)
    pools_taken: dict[str, int] = field(default_factory=dict)
    pools_passed: dict[str, int] = field(default_factory=dict)

    def count(self, i: int, history: str, taken: bool) -> None:
        (self.taken if taken else self.passed).append(i)
        pools = self.pools_taken if taken else self.pools_passed
        name = pool(history)
        pools[name] = pools.get(name, 0) + 1


def choose(
    positions: Sequence[int],
    histories: Sequence[str],
    seed: int,
    floor: float,
    ids: Sequence[str],
    in_round: set[str] | None,
) -> Draw:
    """Take or pass over each cursor position's problem (``ids``), given its history. A problem already in the
    round (``in_round``, updated) is passed over: a round that reaches into the next pass may meet it again (None: a
    round larger than the training set, which must repeat problems, as the cursor's does)."""
    draw = Draw()
    for i, (position, history, problem_id) in enumerate(zip(positions, histories, ids, strict=True)):
        repeated = in_round is not None and problem_id in in_round
        take = not repeated and uniform(seed, position) < draw_chance(history, floor)
        if take and in_round is not None:
            in_round.add(problem_id)
        draw.count(i, history, take)
    return draw


def position_cap(wanted: int, floor: float) -> int:
    """How many positions an actor claims at most for a round of ``wanted`` problems. Past it the round is filled
    with problems it passed over, so that a round is always whole (a synchronous run needs it); were every problem
    at the floor, a round would fall short of it with a chance under 1e-6."""
    return 2 * math.ceil((wanted + 10) / floor)
