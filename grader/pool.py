"""Grading untrusted model output with a time limit per answer.

With ``isolation="process"`` (the default) graders run in a worker process (``python -m grader.worker NAME``,
:class:`grader.session.Session`) that talks msgpack frames over its stdin/stdout (and warms up before it reports
ready, see :mod:`grader.worker`). The parent waits at most ``timeout_s`` for each answer's score; when an answer
hangs the worker (a pathological expression handed to sympy, say), the worker is killed and restarted, that answer
scores 0, and the remaining answers are sent again. A grader that raises, returns something that is not a number in
[0, 1], or crashes its process also scores 0. Every such answer is counted by kind: ``timeout``, ``exception``,
``invalid``, ``crash``.

``isolation="inline"`` calls the grader in-process (no time limit: for trusted, fast graders and unit tests).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from common.rollout import GradeResult, Sample, sample_texts, unjudged_zeros
from grader import build_grader
from grader.protocol import score_one
from grader.session import Session


class GraderPool:
    """Grades (completion, reference) pairs; see the module docstring. Not thread-safe: one per actor loop."""

    def __init__(
        self, name: str | Mapping[str, Any], timeout_s: float = 5.0, isolation: str = "process", memory_mb: int = 0
    ):
        self.name = name  # a grader's name, or a spec with options (see grader.build_grader)
        self.timeout_s = timeout_s
        self.isolation = isolation
        self._fn = build_grader(name)  # fails fast on an unknown name or a bad option, in the caller's process
        self._session: Session | None = None
        if isolation == "process":
            self._session = Session(name, memory_mb, "grader worker")
        elif isolation != "inline":
            raise ValueError(f"isolation must be process or inline, not {isolation!r}")

    def grade(self, pairs: list[tuple[str, str]]) -> GradeResult:
        if self.isolation == "inline":
            return self._grade_inline(pairs)
        assert self._session is not None
        result = GradeResult([0.0] * len(pairs))
        for i, (score, kind) in enumerate(self._session.run([[c, r] for c, r in pairs], self.timeout_s)):
            result.put(i, 0.0 if score is None else float(score), kind)  # None: lost with its worker
        return result

    def _grade_inline(self, pairs: list[tuple[str, str]]) -> GradeResult:
        result = GradeResult([0.0] * len(pairs))
        for i, (completion, reference) in enumerate(pairs):
            result.put(i, *score_one(self._fn, completion, reference))
        return result

    def grade_samples(
        self,
        tokenizer: Any,
        samples: Sequence[Sample],
        references: Sequence[str],
        *,
        require_stop: bool,
        prompts: Sequence[str] | None = None,
    ) -> GradeResult:
        """common.rollout.SampleGrader's: a grader function takes (completion, reference) alone, so ``prompts`` is
        not used here."""
        del prompts
        result = self.grade(list(zip(sample_texts(tokenizer, samples), references, strict=True)))
        return unjudged_zeros(samples, result, require_stop=require_stop)

    def close(self) -> None:
        if self._session is not None:
            self._session.close()

    def __enter__(self) -> GraderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
