"""Reward functions behind one registry, and a pool that runs them under a time limit.

``get_grader(name)`` returns a plain callable ``(completion: str, reference: str) -> float`` in [0, 1]. Callers
that grade untrusted model output use :class:`grader.pool.GraderPool`, which enforces ``grader.timeout_s`` per
answer and turns a crash or time-out into a score of 0 that is counted, never an exception.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import cast

from grader import builtin

Grader = Callable[[str, str], float]

GRADERS: dict[str, Grader] = {
    "addition": builtin.addition,
    "exact": builtin.exact,
    "gsm8k": builtin.gsm8k,
    "math": builtin.math,
}


def get_grader(name: str) -> Grader:
    """A built-in grader by name, or your own as ``package.module:function`` (importable where actors run)."""
    if name in GRADERS:
        return GRADERS[name]
    module, sep, attr = name.partition(":")
    if sep:
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise KeyError(f"grader {name!r} cannot be imported: {e}") from None
        if callable(fn):
            return cast(Grader, fn)
    raise KeyError(f"unknown grader {name!r}; built in: {', '.join(sorted(GRADERS))}, or module.path:function")


__all__ = ["GRADERS", "Grader", "get_grader"]
