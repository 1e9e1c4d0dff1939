"""A Docker engine with Compose v2 for the tests in this folder: the one that answers, or one that
``scripts/docker-engine.sh`` installs and starts (and that is stopped again by its PID when they end).

They skip, saying why, only where no engine can be started: not root, no cgroups, or (outside CI) a set-up that could
not be done here. With ``CI=true`` on a machine that could run one, a failed set-up fails the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def could_run_an_engine() -> bool:
    """Root, and a kernel with cgroups: what a Docker engine needs of this machine."""
    cgroups = Path("/sys/fs/cgroup")
    return os.geteuid() == 0 and cgroups.is_dir() and any(cgroups.iterdir())


def _stop(pid: int, grace_s: float = 60) -> None:
    """Stop the engine this session started (SIGTERM: it stops its containerd too), by its PID."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.2)
    if Path(f"/proc/{pid}").exists():
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")  # stopped as soon as the module's tests end
def docker_engine() -> Iterator[None]:
    done = subprocess.run([str(REPO / "scripts" / "docker-engine.sh")], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["scripts/docker-engine.sh failed"])[-1]
        if os.environ.get("CI") == "true" and could_run_an_engine():
            pytest.fail(f"this machine can run a Docker engine but none could be had: {done.stderr.strip()}")
        pytest.skip(f"no Docker engine: {reason}")
    state = done.stdout.strip().splitlines()[-1]
    started = int(state.split()[1]) if state.startswith("started ") else None
    try:
        yield
    finally:
        if started is not None:
            _stop(started)
