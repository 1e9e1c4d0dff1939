"""Security against a real Redis: a restricted ACL user runs a real learner, the config's credentials win over the
URL's, and rediss:// (TLS, through a loopback TLS terminator) verifies the server's certificate."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from common.config import ConfigError, RedisConfig, load_config
from common.transport import Transport, TransportError, read_balance
from tests.integration.test_learner_process import group, run_learner

pytestmark = pytest.mark.integration

# What a run's processes need, and nothing else: the run's keys and channel, no admin or dangerous commands.
ACL = [
    "grpo", "on", ">s3cret", "resetkeys", "~grpo:{sec}:*", "resetchannels", "&grpo:{sec}:*",
    "-@all", "+@read", "+@write", "+@stream", "+@pubsub", "+@scripting", "+@transaction", "+@connection", "+@keyspace",
    "+time",
    "-@dangerous",
]  # fmt: skip


def test_a_learner_runs_as_a_restricted_acl_user(tiny_model_dir: Path, redis_server, tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("ACL", "SETUSER", *ACL)
    admin.execute_command("ACL", "SETUSER", "default", "off")  # nobody else gets in
    env = {"GRPO_REDIS_USERNAME": "grpo", "GRPO_REDIS_PASSWORD": "s3cret"}
    cfg = load_config(overrides=[f"redis.url={redis_server.url}", "run.name=sec"], env=env)
    t = Transport(cfg.redis, "sec")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    t.produce([group(tok, 0) for _ in range(4)], bound=64)
    t.heartbeat("a", 5, {"version": 0})
    assert list(t.live_actors()) == ["a"] and t.unread() == 4
    processes_env = processes.grpo  # the learner gets the credentials from the environment only
    processes.grpo = lambda *a, **k: processes_env(*a, **k, env=env)
    run_learner(processes, redis_server.url, tiny_model_dir, tmp_path, "sec", 2)
    b = read_balance(t)
    assert b.trained == 4 and b.unexplained == 0
    assert "s3cret" not in (tmp_path / "run" / "config.json").read_text()
    # The user cannot touch another run's keys, nor run admin commands.
    with pytest.raises(redis.exceptions.NoPermissionError):
        t.client.set("grpo:{other}:stats", 1)
    with pytest.raises(redis.exceptions.NoPermissionError):
        t.client.config_get("*")
    t.close()
    # A user without rights on this run gets one line naming the refusal, and exit code 2.
    admin.execute_command("ACL", "SETUSER", "other", "on", ">pw", "~grpo:{other}:*", "+@all")
    cmd = [sys.executable, "-m", "common.cli", "status", "-o", f"redis.url={redis_server.url}", "-o", "run.name=sec"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "GRPO_REDIS_USERNAME": "other", "GRPO_REDIS_PASSWORD": "pw"})  # fmt: skip
    assert done.returncode == 2 and "Redis refused a command to this user" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    admin.close()


def test_the_configs_credentials_win_over_the_urls(redis_server) -> None:  # type: ignore[no-untyped-def]
    admin = redis.Redis.from_url(redis_server.url)
    admin.config_set("requirepass", "right")
    url = redis_server.url.replace("redis://", "redis://:wrong@")
    with pytest.raises(TransportError, match="auth"):
        Transport(RedisConfig(url=url), "x").ping()
    Transport(RedisConfig(url=url, password="right"), "x").ping()
    admin.execute_command("AUTH", "right")
    admin.config_set("requirepass", "")
    admin.close()


def test_tls_options_need_a_rediss_url() -> None:
    with pytest.raises(ConfigError, match=r"tls_ca_file is set but redis\.url is not rediss://"):
        load_config(overrides=["redis.url=redis://127.0.0.1:6379/0", "redis.tls_ca_file=/tmp/ca.pem"], env={})


@pytest.fixture
def tls_terminator(redis_server, tmp_path: Path) -> Iterator[tuple[int, Path]]:  # type: ignore[no-untyped-def]
    """A loopback TLS server that forwards plaintext to the test's Redis (whose own build may lack TLS)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    stop = threading.Event()

    def pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def serve() -> None:
        while not stop.is_set():
            try:
                raw, _ = listener.accept()
            except OSError:
                continue
            try:
                raw.settimeout(None)
                tls = context.wrap_socket(raw, server_side=True)
            except (OSError, ssl.SSLError):
                raw.close()  # a client that does not trust the certificate hangs up here
                continue
            upstream = socket.create_connection(("127.0.0.1", redis_server.port))
            threading.Thread(target=pipe, args=(tls, upstream), daemon=True).start()
            threading.Thread(target=pipe, args=(upstream, tls), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield port, cert
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()


def test_rediss_verifies_the_server_certificate(tls_terminator: tuple[int, Path]) -> None:
    port, cert = tls_terminator
    url = f"rediss://127.0.0.1:{port}/0"
    t = Transport(RedisConfig(url=url, tls_ca_file=str(cert), retries=0), "tls")
    t.ping()
    t.ensure_consumer_group()
    t.produce([b"over tls"])
    assert [e.payload for e in t.read("l", 5, 100)] == [b"over tls"]
    t.close()
    # Without the CA that signed it, the certificate is refused: a clear error, not a silent plaintext fallback.
    with pytest.raises(TransportError, match="certificate verify failed"):
        Transport(RedisConfig(url=url, retries=0), "tls").ping()
