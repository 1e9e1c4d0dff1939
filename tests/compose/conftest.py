"""A Docker engine with Compose v2 for the tests in this folder: the one that answers, or one that
``scripts/docker-engine.sh`` installs and starts (and that is stopped again by its PID when they end).

They skip, saying why, only where no engine can be started: not root, no cgroups, or (outside CI) a set-up that could
not be done here. With ``CI=true`` on a machine that could run one, a failed set-up fails the tests."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.children import wait_until
from tests.conftest import pid_alive

REPO = Path(__file__).resolve().parents[2]


def could_run_an_engine() -> bool:
    """Root, and a kernel with cgroups: what a Docker engine needs of this machine."""
    cgroups = Path("/sys/fs/cgroup")
    return os.geteuid() == 0 and cgroups.is_dir() and any(cgroups.iterdir())


def skip_or_fail(what: str, done: subprocess.CompletedProcess) -> None:
    """A set-up script that could not do its part: a failure under CI on a machine that could have done it, else a
    skip naming the script's last line."""
    reason = (done.stderr.strip().splitlines() or [f"{what} failed"])[-1]
    if os.environ.get("CI") == "true" and could_run_an_engine():
        pytest.fail(
            f"this machine can run a Docker engine but {what} failed: {done.stdout[-2000:]}{done.stderr[-3000:]}"
        )
    pytest.skip(f"{what}: {reason}")


def run_script(args: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A set-up script in a process group of its own: on a time-out the whole group is stopped (debootstrap, pip,
    a build), not the script alone."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, **(env or {})}, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def stop_pid(pid: int, grace_s: float = 60) -> None:
    """Stop the engine this module started (SIGTERM: it stops its containerd too), by its PID."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if not wait_until(lambda: not pid_alive(pid), grace_s, 0.2):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")  # stopped as soon as the module's tests end
def docker_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    # The script writes the PID of an engine it starts here at once: whatever becomes of the script, it is stopped.
    pidfile = tmp_path_factory.mktemp("docker-engine") / "dockerd.pid"
    try:
        done = run_script([str(REPO / "scripts" / "docker-engine.sh")], 900, {"GRPO_DOCKERD_PIDFILE": str(pidfile)})
        if done.returncode != 0:
            skip_or_fail("scripts/docker-engine.sh", done)
        yield
    finally:
        if pidfile.is_file():
            stop_pid(int(pidfile.read_text()))
