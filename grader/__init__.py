"""Reward functions behind one registry, and a pool that runs them under a time limit.

``get_grader(name)`` returns a plain callable ``(completion: str, reference: str) -> float`` in [0, 1]. Callers
that grade untrusted model output use :class:`grader.pool.GraderPool`, which enforces ``grader.timeout_s`` per
answer and turns a crash or time-out into a score of 0 that is counted, never an exception.
"""

from __future__ import annotations

from collections.abc import Callable

from grader import builtin

Grader = Callable[[str, str], float]

GRADERS: dict[str, Grader] = {
    "addition": builtin.addition,
    "exact": builtin.exact,
    "gsm8k": builtin.gsm8k,
    "math": builtin.math,
}


def get_grader(name: str) -> Grader:
    try:
        return GRADERS[name]
    except KeyError:
        raise KeyError(f"unknown grader {name!r}; known: {', '.join(sorted(GRADERS))}") from None


__all__ = ["GRADERS", "Grader", "get_grader"]
