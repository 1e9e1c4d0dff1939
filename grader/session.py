"""The parent's side of a worker process (``python -m grader.worker``) that graders and tools run in: started with a
memory limit, fed batches in msgpack frames, each item's reply awaited within a time limit, and killed and restarted
when an item hangs it or it dies (:class:`Session`). The child's side is :mod:`grader.worker`; the frames,
:mod:`grader.protocol`.
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
from collections.abc import Callable, Mapping
from typing import Any

import msgpack

from common.children import die_with_parent, stop_process
from common.rollout import GraderErrorKind
from grader.protocol import HEADER as _HEADER
from grader.protocol import write_frame

log = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0


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
            # One string hashing in every worker: a grader that regenerates what a task generated (reasoning-gym's
            # datasets, some of which draw from sets of strings) gets what common.tasks.gym's child got.
            env={**os.environ, "PYTHONHASHSEED": "0"},
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
