"""Whether a role's loop still moves: the loop beats at each of its named steps, and ``/healthz`` fails once the
current step has gone without a beat for longer than its bound.

A process can live while its loop is stuck: a grader call that never returns in the loop's thread, a deadlock, a
blocking call with no time limit. The metrics server's thread answers either way, so only the loop can say that it
moves. It calls :meth:`Liveness.beat` with what it is doing at each named step (``training step 12``,
``evaluating``, ``sampling a round``), and again and again while it waits for something that may legitimately take
long (groups from slow actors, room in the stream): a slow but healthy run beats. A step whose length another
setting bounds declares that bound instead of the default (waiting for the run's lease: ``learner.held_wait_s``;
starting a SGLang server: ``sglang.ready_timeout_s``). The default bound is ``metrics.stall_after_s``: longer than
any step of a healthy loop that does not beat as it goes (a training step, an evaluation, loading the model,
writing a checkpoint or a version).

Readiness is separate from liveness: the steps of the start (connecting, waiting for the lease, loading the model
or starting the engine) are alive but not ready; the first step of the loop's own work makes the process ready
(``/readyz``), and a stall makes it neither. The first report of a stall logs the loop thread's stack once, so that
the log says where it hangs before a supervisor restarts the process.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

log = logging.getLogger(__name__)


class Liveness:
    """The loop's last beat: what it does, since when, and within what bound it must beat again. ``facts`` (and
    those a beat gives) are reported as they are: the role, its step or policy version."""

    def __init__(
        self,
        stall_after_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        **facts: Any,
    ):
        self.stall_after_s = stall_after_s
        self._clock, self._wall = clock, wall
        self._lock = threading.Lock()  # beats come from the loop's thread, reports from the server's
        now = clock()
        self._doing, self._since, self._last, self._allow_s = "starting", now, now, stall_after_s
        self._ready = False
        self._thread = threading.get_ident()  # whose stack a stall logs: the thread that beats
        self._facts: dict[str, Any] = dict(facts)
        self._stall_logged = False

    def beat(self, doing: str, allow_s: float | None = None, *, starting: bool = False, **facts: Any) -> None:
        """The loop is at ``doing`` now (a new step, or the same one still moving): it must beat again within
        ``allow_s`` (default ``stall_after_s``). ``starting``: a step of the start, alive but not ready yet."""
        now = self._clock()
        with self._lock:
            if doing != self._doing:
                self._doing, self._since = doing, now
            self._last = now
            self._allow_s = self.stall_after_s if allow_s is None else allow_s
            self._ready = self._ready or not starting
            self._thread = threading.get_ident()
            self._facts.update(facts)
            self._stall_logged = False

    def report(self) -> tuple[bool, dict[str, Any]]:
        """``(ok, info)``: ok while the last beat is within its bound; info says what the loop is doing, since when
        (``since``, UTC, and ``for_s``), how long since its last beat (``quiet_s``), the bound (``stall_after_s``),
        whether the start is over (``ready``), the facts, and where the loop's thread is when it has stalled."""
        now, wall = self._clock(), self._wall()
        with self._lock:
            quiet = now - self._last
            ok = quiet <= self._allow_s
            info: dict[str, Any] = {
                **self._facts,
                "doing": self._doing,
                "since": datetime.fromtimestamp(wall - (now - self._since), timezone.utc).isoformat(timespec="seconds"),
                "for_s": round(now - self._since, 1),
                "quiet_s": round(quiet, 1),
                "stall_after_s": self._allow_s,
                "ready": self._ready and ok,
            }
            first_stall = not ok and not self._stall_logged
            self._stall_logged = self._stall_logged or not ok
            thread = self._thread
        if not ok:
            stack = thread_stack(thread)
            info["stuck_at"] = stack[-1].strip().splitlines()[0] if stack else "the loop's thread has ended"
            if first_stall:
                log.error("the loop has not moved for %.0fs while %s (bound %.0fs: metrics.stall_after_s or the "
                          "step's own); /healthz fails until it beats again. Its thread's stack:\n%s", quiet,
                          info["doing"], info["stall_after_s"], "".join(stack))  # fmt: skip
        return ok, info


def thread_stack(ident: int) -> list[str]:
    """The formatted stack of the thread ``ident``, innermost frame last (empty when the thread has ended)."""
    frame = sys._current_frames().get(ident)
    return traceback.format_stack(frame) if frame is not None else []
