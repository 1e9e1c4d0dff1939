"""Tools a model calls in an episode (env/environment.py), run like graders: in a worker process
(``python -m grader.worker '{"tool": "module:function", ...}'``, grader.session) with a time limit per call and a
memory limit, restarted when a call hangs or kills it. A tool is a function ``(call: str) -> str``: the call's text
as the model wrote it between ``env.call_open`` and ``env.call_close``, and the result's text that goes back into the
episode.

Built in: ``calculator`` (:mod:`env.calculator`). Your own: ``module.path:function``, importable where actors
(and the learner, which evaluates with the tool) run.

A call's outcome is its result, or the reason it failed, counted by kind as grader errors are: ``timeout`` (past
``env.timeout_s``: the worker is killed and restarted), ``crash`` (the worker died), ``memory`` (past
``env.memory_mb``), ``exception`` (the tool raised: a malformed call, say), ``invalid`` (it returned no text).
The pool never raises for a call: the episode ends, the actor goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.rollout import GraderErrorKind
from grader import import_function
from grader.session import Session

Tool = Callable[[str], str]

BUILT_IN = {"calculator": "env.calculator:calculator"}  # a tool's name -> the function the worker imports


def tool_function(name: str) -> str:
    """``module.path:function`` of the tool ``name`` (the built-in ``calculator``, or a ``module.path:function``),
    checked importable here, in the caller's process; KeyError naming what is wrong."""
    spec = BUILT_IN.get(name, name)
    import_function(spec, "tool", "calculator")
    return spec


@dataclass(frozen=True)
class ToolResult:
    text: str | None  # None when the call failed
    error: GraderErrorKind | None = None


class ToolPool:
    """Runs calls of one tool in a worker (see the module docstring). Not thread-safe: one per episode runner."""

    def __init__(self, tool: str, *, timeout_s: float, memory_mb: int, max_chars: int):
        self.timeout_s = timeout_s
        spec = {"tool": tool_function(tool), "max_chars": max_chars}  # a name that cannot be imported fails here
        self._session = Session(spec, memory_mb, "tool worker")

    def call(self, calls: list[str]) -> list[ToolResult]:
        if not calls:
            return []
        return [ToolResult(text, error) for text, error in self._session.run(list(calls), self.timeout_s)]

    def close(self) -> None:
        self._session.close()

    def __enter__(self) -> ToolPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
