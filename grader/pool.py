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
import resource
import select
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from common import grader_names
from common.config import ConfigError, GraderConfig
from common.metrics import GraderErrorKind
from common.procs import die_with_parent, stop_process
from common.rollout import completion_text
from grader import build_grader
from grader.episodes import failed
from grader.protocol import HEADER as _HEADER
from grader.protocol import score_one, write_frame

log = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0


@dataclass
class GradeResult:
    scores: list[float]
    errors: Counter[str] = field(default_factory=Counter)

    def put(self, i: int, score: float, kind: str | None) -> None:
        """Answer ``i``'s score, and its error counted when there is one."""
        self.scores[i] = score
        if kind:
            self.errors[kind] += 1


class _WorkerDied(Exception):
    pass


def _limited(memory_mb: int) -> Callable[[], None]:
    """``preexec_fn`` of a worker: it dies with its parent and, with ``memory_mb``, its address space is capped
    there (RLIMIT_AS): a grader or tool that asks for more gets a MemoryError (scored, counted as ``memory``) or
    dies (``crash``), and the actor's own memory is never at stake."""

    def setup() -> None:
        die_with_parent()
        if memory_mb:
            limit = memory_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return setup


class _Worker:
    """One grader (or tool) process and the read side of its pipe."""

    def __init__(self, name: str | Mapping[str, Any], memory_mb: int = 0):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grader.worker", name if isinstance(name, str) else json.dumps(name)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            preexec_fn=_limited(memory_mb),
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


class Session:
    """A worker process kept across batches and restarted when lost. A batch goes in one frame and each item comes
    back in order within ``timeout_s`` of the previous: an item that hangs the worker (a pathological expression
    handed to sympy, a tool that never returns) or kills it gets ``(None, "timeout" | "crash")``, the worker is
    killed and restarted, and the items after it are sent to the fresh one."""

    def __init__(self, spec: str | Mapping[str, Any], memory_mb: int, what: str):
        self.spec, self.memory_mb, self.what = spec, memory_mb, what
        self.worker: _Worker | None = _Worker(spec, memory_mb)  # started now: a broken spec fails at start-up

    def run(self, items: list[Any], timeout_s: float) -> list[tuple[Any, GraderErrorKind | None]]:
        out: list[tuple[Any, GraderErrorKind | None]] = []
        while len(out) < len(items):
            out += self._from(items, len(out), timeout_s)
        return out

    def _from(self, items: list[Any], start: int, timeout_s: float) -> list[tuple[Any, GraderErrorKind | None]]:
        """Replies to items[start:], up to and including the one that lost the worker."""
        if self.worker is None:
            self.worker = _Worker(self.spec, self.memory_mb)
        got: list[tuple[Any, GraderErrorKind | None]] = []
        kind: GraderErrorKind
        try:
            self.worker.send(items[start:])
            while start + len(got) < len(items):
                index, value, error = self.worker.read(timeout_s)
                if index != len(got):
                    raise _WorkerDied(f"out-of-order reply {index} for {len(got)}")
                got.append((value, error))
            return got
        except TimeoutError:
            kind = "timeout"
        except _WorkerDied as e:
            log.warning("%s died (%s); restarting it", self.what, e)
            kind = "crash"
        self.close()
        return [*got, (None, kind)]

    def close(self) -> None:
        if self.worker is not None:
            self.worker.kill()
            self.worker = None


def sample_texts(tokenizer: Any, samples: list[Any]) -> list[str]:
    """The text graded for each generated sample (``common.model.generation.Sample``): its completion without the
    stop token. Every grader (the pool, a scoring service) takes its texts from here alone."""
    # An episode's text is its last model turn (grader.episodes): the answer, after the calls and their results.
    return [completion_text(tokenizer, s.token_ids[s.answer_from :], s.finish_reason) for s in samples]


def require_stopped(samples: list[Any], result: GradeResult, *, require_stop: bool) -> GradeResult:
    """``result`` with each sample that did not stop (cut off at the length limit) scored 0 when ``require_stop``:
    an answer that was never finished earns nothing, whatever its text scored."""
    if require_stop:
        result.scores = [0.0 if s.finish_reason != "stop" else r for s, r in zip(samples, result.scores, strict=True)]
    # An episode a tool failure ended scores 0 whatever its last turn says (counted by the actor as its end).
    result.scores = [0.0 if failed(s) else r for s, r in zip(samples, result.scores, strict=True)]
    return result


def open_grader(cfg: GraderConfig) -> GraderPool:
    """The pool a role grades with (an HTTP scorer's client for ``grader.name=service``); an unknown or unimportable
    grader is a user's config mistake."""
    if cfg.name == grader_names.SERVICE:
        from grader.service import ServiceGrader  # imported here: it builds on this module

        return ServiceGrader(
            cfg.url, timeout_s=cfg.timeout_s, batch_size=cfg.batch_size, retries=cfg.retries,
            retry_backoff_s=cfg.retry_backoff_s, round_budget_s=cfg.round_budget_s,
        )  # fmt: skip
    try:
        return GraderPool(cfg.spec(), cfg.timeout_s, cfg.isolation, cfg.memory_mb)
    except KeyError as e:
        raise ConfigError(f"config error: grader.name: {e.args[0]}") from None


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
        samples: list[Any],
        references: list[str],
        *,
        require_stop: bool,
        prompts: list[str] | None = None,
    ) -> GradeResult:
        """Rewards of generated samples (``common.model.generation.Sample``): the grader sees each one's text from
        :func:`sample_texts`, and with ``require_stop`` a completion cut off at the length limit scores 0 (it never
        finished its answer). ``prompts`` is for graders that read the question (a scoring service); a grader
        function takes (completion, reference) alone, so the pool ignores it."""
        del prompts
        result = self.grade(list(zip(sample_texts(tokenizer, samples), references, strict=True)))
        return require_stopped(samples, result, require_stop=require_stop)

    def close(self) -> None:
        if self._session is not None:
            self._session.close()

    def __enter__(self) -> GraderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
