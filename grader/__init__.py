"""Reward functions behind one registry, and a pool that runs them under a time limit.

``get_grader(name)`` returns a plain callable ``(completion: str, reference: str) -> float`` in [0, 1]. Callers
that grade untrusted model output use :class:`grader.pool.GraderPool`, which enforces ``grader.timeout_s`` per
answer and turns a crash or time-out into a score of 0 that is counted, never an exception.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable, Mapping
from typing import Any, cast

from common import grader_names
from grader import builtin

Grader = Callable[[str, str], float]

# Built from the one list of names the config accepts; each plain grader is the function of its name in builtin.
GRADERS: dict[str, Grader] = {name: getattr(builtin, name) for name in grader_names.PLAIN}


def get_grader(name: str) -> Grader:
    """A built-in grader by name, or your own as ``package.module:function`` (importable where actors run)."""
    if name in GRADERS:
        return GRADERS[name]
    return cast(Grader, import_function(name, "grader", ", ".join(sorted(GRADERS))))


def import_function(name: str, what: str, built_in: str) -> Callable[..., Any]:
    """Your own grader or tool, ``package.module:function``; KeyError saying what is wrong (``what`` names the kind,
    ``built_in`` lists the built-in names)."""
    module, sep, attr = name.partition(":")
    if sep:
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise KeyError(f"{what} {name!r} cannot be imported: {e}") from None
        if callable(fn):
            return cast(Callable[..., Any], fn)
    raise KeyError(f"unknown {what} {name!r}; built in: {built_in}, or module.path:function")


def build_grader(spec: str | Mapping[str, Any]) -> Grader:
    """A grader from its name, or from a spec with options (JSON-able, so that a worker process can rebuild it):
    ``{"name": "regex", "pattern": "answer: (\\S+)"}``, ``{"name": "format", "pattern": ""}`` (empty: the
    think/answer layout), or ``{"name": "combine", "components": [{"name": "gsm8k", "weight": 0.9}, {"name":
    "format", "weight": 0.1}]}``: the weighted mean of its components' scores."""
    if isinstance(spec, str):
        return get_grader(spec)
    name = spec["name"]
    if name == grader_names.REGEX:
        pattern = re.compile(spec["pattern"], re.DOTALL)
        if pattern.groups != 1:
            raise KeyError(f"grader regex: the pattern needs exactly one group (the answer), it has {pattern.groups}")
        return functools.partial(builtin.regex, pattern=pattern)
    if name == grader_names.FORMAT:
        return functools.partial(builtin.format_match, pattern=re.compile(spec.get("pattern") or builtin.DEFAULT_FORMAT,
                                                                          re.DOTALL))  # fmt: skip
    if name == grader_names.COMBINE:
        parts = [(build_grader(c), float(c.get("weight", 1.0))) for c in spec.get("components") or []]
        total = sum(w for _, w in parts)
        if not parts or total <= 0:
            raise KeyError("grader combine: needs components with positive weights")
        return lambda completion, reference: sum(w * fn(completion, reference) for fn, w in parts) / total
    return get_grader(name)


__all__ = ["GRADERS", "Grader", "build_grader", "get_grader", "import_function"]
