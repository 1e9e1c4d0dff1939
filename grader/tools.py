"""Tools a model calls in an episode (grader/environment.py), run like graders: in a worker process
(``python -m grader.worker '{"tool": ...}'``) with a time limit per call and a memory limit, restarted when a call
hangs or kills it. A tool is a function ``(call: str) -> str``: the call's text as the model wrote it between
``env.call_open`` and ``env.call_close``, and the result's text that goes back into the episode.

Built in: ``calculator`` (:mod:`grader.calculator`). Your own: ``module.path:function``, importable where actors
(and the learner, which evaluates with the tool) run.

A call's outcome is its result, or the reason it failed, counted by kind as grader errors are: ``timeout`` (past
``env.timeout_s``: the worker is killed and restarted), ``crash`` (the worker died), ``memory`` (past
``env.memory_mb``), ``exception`` (the tool raised: a malformed call, say), ``invalid`` (it returned no text).
The pool never raises for a call: the episode ends, the actor goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from grader import import_function

if TYPE_CHECKING:  # the worker process that runs tools imports this module: no metrics library there
    from common.metrics import GraderErrorKind

Tool = Callable[[str], str]


def get_tool(name: str) -> Tool:
    """The built-in ``calculator``, or ``module.path:function``; KeyError naming what is wrong."""
    if name == "calculator":
        from grader.calculator import calculator

        return calculator
    return cast(Tool, import_function(name, "tool", "calculator"))


@dataclass(frozen=True)
class ToolResult:
    text: str | None  # None when the call failed
    error: GraderErrorKind | None = None


class ToolPool:
    """Runs calls of one tool in a worker (see the module docstring). Not thread-safe: one per episode runner."""

    def __init__(self, tool: str, *, timeout_s: float, memory_mb: int, max_chars: int):
        from grader.pool import Session  # torch-free here; the pool module is the parent's side

        get_tool(tool)  # fails fast, in the caller's process, on a name that cannot be imported
        self.timeout_s = timeout_s
        self._session = Session({"tool": tool, "max_chars": max_chars}, memory_mb, "tool worker")

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
