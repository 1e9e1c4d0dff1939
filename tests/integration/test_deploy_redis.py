"""The Redis start script and healthcheck of docker-compose.yml and deploy/kubernetes, run against a real
redis-server: the password reaches the server from the secret's file, and only from there.

No Docker engine here: the image's entrypoint and its ``redis`` user are stood in for by small scripts on PATH, and the
container's paths (``/run/secrets``, ``/run/redis-conf``) by temporary ones. Two images: the official one, whose
entrypoint drops root, and Debian's redis-server (``scripts/build-images.sh --offline``), which has no entrypoint and
is started as its user with setpriv. (tests/compose runs both scripts in real containers.)
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import redis
import yaml

from common.children import die_with_parent, stop_process, wait_until
from common.ports import free_port
from ops.redis_server import find_redis_server

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def compose_interpolate(text: str) -> str:
    """What docker compose does to a value: ``$$`` is a ``$``, ``${VAR:-default}`` its default (nothing is set)."""
    text = re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", text)
    return text.replace("$$", "$")


def kubernetes_interpolate(text: str) -> str:
    """What the kubelet does to a command: ``$$`` is a ``$`` (the script names no ``$(VAR)``)."""
    return text.replace("$$", "$")


def redis_service() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["redis"]


def redis_container() -> dict:
    docs = yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "redis.yaml").read_text())
    (sts,) = [d for d in docs if d and d["kind"] == "StatefulSet"]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    return c


class Container:
    """A stand-in for the redis image: its entrypoint and chown on PATH, its secret and tmpfs in a directory."""

    def __init__(self, root: Path, password: str, official: bool = True):
        self.root = root
        self.bin = root / "bin"
        self.bin.mkdir(parents=True)
        server = Path(find_redis_server())
        (self.bin / "redis-server").symlink_to(server)
        self.port = free_port()
        # The image's entrypoint ends in `exec gosu redis redis-server CONF --protected-mode no ...`, and its Redis
        # listens on 6379; here the port and data directory are this test's.
        listen = f"--port {self.port} --bind 127.0.0.1 --dir {root}"
        if official:
            self._script("docker-entrypoint.sh", f'exec "$@" {listen}')
        else:  # Debian's image: `setpriv --reuid=redis --regid=redis --init-groups redis-server ...`, as root
            self._script("setpriv", f'echo "$1 $2 $3" > {root}/setpriv; shift 3; exec "$@" {listen}')
        self._script("redis-cli", f'exec {server.with_name("redis-cli")} -p {self.port} "$@"')
        self._script("chown", f'echo "$@" > {root}/chowned')  # the image has a redis user; this machine may not
        self.secret = root / "secrets" / "redis_password"
        self.secret.parent.mkdir()
        self.secret.write_text(password + "\n")  # a file secret may end with a newline
        self.conf_dir = root / "redis-conf"
        self.conf_dir.mkdir()
        self.env = {**os.environ, "PATH": f"{self.bin}:{os.environ['PATH']}"}

    def _script(self, name: str, body: str) -> None:
        path = self.bin / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)

    def paths(self, text: str) -> str:
        return text.replace("/run/secrets/redis_password", str(self.secret)).replace(
            "/run/redis-conf", str(self.conf_dir)
        )

    def healthy(self, check: list[str]) -> bool:
        kind, *rest = check
        args = ["sh", "-c", self.paths(rest[0])] if kind == "CMD-SHELL" else [self.paths(a) for a in rest]
        return subprocess.run(args, env=self.env, capture_output=True, timeout=30).returncode == 0


@pytest.fixture
def password() -> str:
    return secrets.token_urlsafe(24) + '"\\%s$'  # quotes, backslashes, printf and shell characters arrive intact


@pytest.fixture(params=["official", "debian"])
def container(request: pytest.FixtureRequest, tmp_path: Path, password: str) -> Iterator[Container]:
    yield Container(tmp_path, password, official=request.param == "official")


def start(container: Container, command: list[str], password: str) -> subprocess.Popen:
    proc = subprocess.Popen([container.paths(a) for a in command], env=container.env, preexec_fn=die_with_parent)
    client = redis.Redis(port=container.port, password=password, socket_connect_timeout=0.5)

    def answers() -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return proc.poll() is not None  # it died: stop waiting, the assertions say why

    try:
        assert wait_until(answers, 20) and proc.poll() is None
    except BaseException:
        stop_process(proc, grace_s=5, name="redis-server")
        raise
    finally:
        client.close()
    return proc


@pytest.mark.parametrize("where", ["compose", "kubernetes"])
def test_the_redis_script_demands_the_secrets_password(container: Container, password: str, where: str) -> None:
    if where == "compose":
        service = redis_service()
        command = [compose_interpolate(a) for a in service["command"]]
        check = [compose_interpolate(a) for a in service["healthcheck"]["test"]]
    else:
        c = redis_container()
        command = [kubernetes_interpolate(a) for a in c["command"]]
        check = ["CMD", *(kubernetes_interpolate(a) for a in c["readinessProbe"]["exec"]["command"])]
    proc = start(container, command, password)
    try:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=container.port).ping()
        assert redis.Redis(port=container.port, password=password).ping()
        assert redis.Redis(port=container.port, password=password).config_get("appendonly") == {"appendonly": "yes"}
        conf = container.conf_dir / "redis.conf"
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600  # readable by the redis user alone
        assert (container.root / "chowned").read_text().split() == ["redis", str(conf)]
        if (container.bin / "setpriv").exists():  # no entrypoint in the image: the script drops root itself
            assert (container.root / "setpriv").read_text().split() == [
                "--reuid=redis",
                "--regid=redis",
                "--init-groups",
            ]
        assert password not in " ".join(cast(list[str], proc.args))
        assert container.healthy(check)
        container.secret.write_text("wrong\n")
        assert not container.healthy(check)  # a healthcheck that cannot authenticate fails
    finally:
        stop_process(proc, grace_s=5, name="redis-server")
