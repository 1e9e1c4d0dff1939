"""The private redis-server of ``grpo run`` (ops.redis_server) with a password: a real server, real clients."""

from __future__ import annotations

import secrets
import stat
from pathlib import Path
from typing import cast

import pytest
import redis

from ops.redis_server import RedisServer

pytestmark = pytest.mark.integration


def test_a_password_refuses_strangers_and_stays_off_the_command_line(tmp_path: Path) -> None:
    password = secrets.token_urlsafe(32) + '"\\'  # quotes and backslashes reach the server intact
    server = RedisServer(tmp_path / "redis", password=password).start()
    try:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url).ping()
        assert redis.Redis.from_url(server.url, password=password).ping()
        assert server.proc is not None
        argv = " ".join(cast(list[str], server.proc.args))
        assert password not in argv  # what `ps` would have shown before Redis renames itself
        # The operator's copy: readable by its owner only.
        assert server.password_file.read_text() == password + "\n"
        assert stat.S_IMODE(server.password_file.stat().st_mode) == 0o600
        server.restart()  # fault tests restart it: the password holds
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url).ping()
        assert redis.Redis.from_url(server.url, password=password).ping()
    finally:
        server.stop()
