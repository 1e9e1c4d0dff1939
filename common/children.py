"""Child-process hygiene shared by every process that starts another one.

A child must never outlive the process that started it: on Linux each child asks the kernel to send it SIGTERM when
its parent dies (``PR_SET_PDEATHSIG``), which covers the parent being killed with SIGKILL, where no cleanup code runs.
Children are stopped by PID only: SIGTERM, a grace period, then SIGKILL.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import sys
import time

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for subprocess.Popen: SIGTERM this child when its parent thread exits (Linux only)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0, name: str = "") -> int | None:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL. Returns the exit code (None if it could not be reaped)."""
    if proc.poll() is not None:
        return proc.returncode
    try:
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        log.warning("%s (pid %d) ignored SIGTERM for %.0fs; killing it", name or "child", proc.pid, grace_s)
        proc.kill()
        try:
            return proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None
    except ProcessLookupError:
        return proc.poll()


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())
