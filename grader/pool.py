"""Grading untrusted model output with a time limit per answer.

With ``isolation="process"`` (the default) graders run in a worker process (``python -m grader.worker NAME``) that
talks msgpack frames over its stdin/stdout (and warms up before it reports ready, see :mod:`grader.worker`). The
parent waits at most ``timeout_s`` for each answer's score; when an answer hangs the worker (a pathological
expression handed to sympy, say), the worker is killed and restarted, that answer scores 0, and the remaining answers
are sent again. A grader that raises, returns something that is not a
number in [0, 1], or crashes its process also scores 0. Every such answer is counted by kind: ``timeout``,
``exception``, ``invalid``, ``crash``.

``isolation="inline"`` calls the grader in-process (no time limit: for trusted, fast graders and unit tests).
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from common.config import ConfigError, GraderConfig
from common.metrics import GraderErrorKind
from common.model.generation import completion_text
from common.procs import die_with_parent, stop_process
from grader import build_grader
from grader.protocol import HEADER as _HEADER
from grader.protocol import score_one, write_frame

log = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0


@dataclass
class GradeResult:
    scores: list[float]
    errors: Counter[str] = field(default_factory=Counter)


class _WorkerDied(Exception):
    pass


class _Worker:
    """One grader process and the read side of its pipe."""

    def __init__(self, name: str | Mapping[str, Any]):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grader.worker", name if isinstance(name, str) else json.dumps(name)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            preexec_fn=die_with_parent,
        )
        self._buf = b""
        ready = self.read(_STARTUP_TIMEOUT_S)
        if ready != "ready":
            self.kill()
            raise RuntimeError(f"grader worker for {name!r} did not start: {ready!r}")

    def send(self, obj: Any) -> None:
        try:
            write_frame(self.proc.stdin, obj)
        except (BrokenPipeError, OSError) as e:
            raise _WorkerDied(str(e)) from None

    def read(self, timeout_s: float) -> Any:
        """The next frame, or TimeoutError, or _WorkerDied at end of file."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while True:
            if len(self._buf) >= _HEADER.size:
                (n,) = _HEADER.unpack_from(self._buf)
                if len(self._buf) >= _HEADER.size + n:
                    body = self._buf[_HEADER.size : _HEADER.size + n]
                    self._buf = self._buf[_HEADER.size + n :]
                    return msgpack.unpackb(body, raw=False)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            readable, _, _ = select.select([fd], [], [], remaining)
            if readable:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise _WorkerDied(f"exit code {self.proc.wait()}")
                self._buf += chunk

    def kill(self) -> None:
        stop_process(self.proc, grace_s=0.5, name="grader worker")
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def open_grader(cfg: GraderConfig) -> GraderPool:
    """The pool a role grades with; an unknown or unimportable grader is a user's config mistake."""
    try:
        return GraderPool(cfg.spec(), cfg.timeout_s, cfg.isolation)
    except KeyError as e:
        raise ConfigError(f"config error: grader.name: {e.args[0]}") from None


class GraderPool:
    """Grades (completion, reference) pairs; see the module docstring. Not thread-safe: one per actor loop."""

    def __init__(self, name: str | Mapping[str, Any], timeout_s: float = 5.0, isolation: str = "process"):
        self.name = name  # a grader's name, or a spec with options (see grader.build_grader)
        self.timeout_s = timeout_s
        self.isolation = isolation
        self._fn = build_grader(name)  # fails fast on an unknown name or a bad option, in the caller's process
        self._worker: _Worker | None = None
        if isolation == "process":
            self._worker = _Worker(name)
        elif isolation != "inline":
            raise ValueError(f"isolation must be process or inline, not {isolation!r}")

    def grade(self, pairs: list[tuple[str, str]]) -> GradeResult:
        if self.isolation == "inline":
            return self._grade_inline(pairs)
        result = GradeResult([0.0] * len(pairs))
        start = 0
        while start < len(pairs):
            start = self._grade_with_worker(pairs, start, result)
        return result

    def _grade_inline(self, pairs: list[tuple[str, str]]) -> GradeResult:
        result = GradeResult([0.0] * len(pairs))
        for i, (completion, reference) in enumerate(pairs):
            result.scores[i], kind = score_one(self._fn, completion, reference)
            if kind:
                result.errors[kind] += 1
        return result

    def _grade_with_worker(self, pairs: list[tuple[str, str]], start: int, result: GradeResult) -> int:
        """Send pairs[start:], collect scores; returns where to resume after a lost worker (len(pairs) when done)."""
        if self._worker is None:
            self._worker = _Worker(self.name)
        worker = self._worker
        i = start
        kind: GraderErrorKind
        try:
            worker.send([[c, r] for c, r in pairs[start:]])
            while i < len(pairs):
                index, score, kind = worker.read(self.timeout_s)
                if index != i - start:
                    raise _WorkerDied(f"out-of-order reply {index} for {i - start}")
                result.scores[i] = float(score)
                if kind:
                    result.errors[kind] += 1
                i += 1
            return i
        except TimeoutError:
            kind = "timeout"
        except _WorkerDied as e:
            log.warning("grader worker died (%s); restarting it", e)
            kind = "crash"
        # The answer being graded when the worker was lost scores 0; the rest are sent to a fresh worker.
        worker.kill()
        self._worker = None
        result.scores[i] = 0.0
        result.errors[kind] += 1
        return i + 1

    def grade_samples(
        self, tokenizer: Any, samples: list[Any], references: list[str], *, require_stop: bool
    ) -> GradeResult:
        """Rewards of generated samples (``common.model.generation.Sample``): the grader sees the completion's text
        without its stop token, and with ``require_stop`` a completion cut off at the length limit scores 0 (it never
        finished its answer)."""
        result = self.grade(
            [
                (completion_text(tokenizer, s.token_ids, s.finish_reason), ref)
                for s, ref in zip(samples, references, strict=True)
            ]
        )
        if require_stop:
            result.scores = [
                0.0 if s.finish_reason != "stop" else r for s, r in zip(samples, result.scores, strict=True)
            ]
        return result

    def close(self) -> None:
        if self._worker is not None:
            self._worker.kill()
            self._worker = None

    def __enter__(self) -> GraderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
