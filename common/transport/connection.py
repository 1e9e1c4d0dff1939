"""The connection to Redis that every part of the transport (common.transport) shares: the URL (plain, TLS or
Sentinel), the bounded retry policy that logs each attempt, the run's key names, and the Lua scripts' registration."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.commands.core import Script
from redis.connection import parse_url
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from common.config import RedisConfig

# One logger for the whole transport, whichever file the code is in: operators and tests quiet or watch it by name.
log = logging.getLogger("common.transport")

CONSUMER_GROUP = "learners"
T = TypeVar("T")


@dataclass(frozen=True)
class SentinelURL:
    hosts: list[tuple[str, int]]
    service: str
    db: int
    username: str | None
    password: str | None
    tls: bool


def parse_sentinel_url(url: str) -> SentinelURL:
    """``redis+sentinel://[user:pass@]host[:26379][,host[:port]...]/<primary name>[/<db>]`` (``rediss+sentinel``
    with TLS)."""
    parts = urlsplit(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    hosts = []
    for item in hostlist.split(","):
        if item.startswith("["):  # an IPv6 address: [::1]:26379
            host, _, rest = item[1:].partition("]")
            colon, port = rest[:1], rest[1:]
            ok = bool(host) and (rest == "" or (colon == ":" and port.isdigit()))
        else:
            host, colon, port = item.rpartition(":") if ":" in item else (item, "", "")
            ok = bool(host) and (not colon or port.isdigit())
        if not ok or (port and not 0 < int(port) < 65536):
            raise ValueError(f"sentinel address {item!r} is not host[:port]")
        hosts.append((host, int(port) if port else 26379))
    if parts.query:
        raise ValueError(f"options in the URL (?{parts.query}) are not read for Sentinel: use the config's redis.*")
    path = [p for p in parts.path.split("/") if p]
    if not 1 <= len(path) <= 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError("the path must be /<primary name>[/<db>], the name sentinel monitors")
    return SentinelURL(
        hosts,
        unquote(path[0]),
        int(path[1]) if len(path) == 2 else 0,
        unquote(username) or None,
        unquote(password) or None,
        parts.scheme.lower() == "rediss+sentinel",
    )


class TransportError(RuntimeError):
    """Redis could not be reached (after the configured retries) or refused us; the message says which."""


class Keys:
    """Key names of one run (the contract of DESIGN §4)."""

    def __init__(self, run: str):
        self.prefix = f"grpo:{{{run}}}:"
        self.groups = self.prefix + "groups"
        self.dead = self.prefix + "dead"
        self.weights_latest = self.prefix + "weights:latest"
        self.weights_channel = self.prefix + "weights"
        self.prompts_cursor = self.prefix + "prompts:cursor"
        self.prompts_record = self.prefix + "prompts:record"
        self.prompts_choices = self.prefix + "prompts:choices"
        self.stats = self.prefix + "stats"
        self.done = self.prefix + "done"
        self.trained_ids = self.prefix + "trained_ids"
        self.inflight = self.prefix + "inflight"
        self.filtered = self.prefix + "filtered"
        self.identity = self.prefix + "identity"
        self.lease = self.prefix + "learner:lease"
        self.lease_token = self.prefix + "learner:token"
        self.nccl_members = self.prefix + "nccl:members"
        self.nccl_round = self.prefix + "nccl:round"
        self.nccl_ready = self.prefix + "nccl:ready"
        self.nccl_state = self.prefix + "nccl:state"

    def actor(self, actor_id: str) -> str:
        return f"{self.prefix}actors:{actor_id}"


class _LoggingRetry(Retry):
    """redis-py's bounded retry with backoff, logging ``attempt i/n`` and counting reconnects."""

    def __init__(self, retries: int, backoff_max_s: float, on_retry: Callable[[], None]):
        super().__init__(ExponentialBackoff(cap=backoff_max_s, base=0.05), retries)
        self._on_retry = on_retry

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):  # type: ignore[no-untyped-def, override]
        def retryable(error: Exception) -> bool:
            # A wrong password or a missing permission will not be fixed by reconnecting: report it at once.
            if isinstance(error, (redis.AuthenticationError, redis.exceptions.AuthorizationError)):
                return False
            return is_retryable is None or bool(is_retryable(error))

        attempt = 0
        total = self._retries + 1

        def failed(error: Exception, *count: int) -> None:
            nonlocal attempt
            attempt += 1
            retrying = "reconnecting" if attempt < total else "giving up"
            log.warning("redis: %s (attempt %d/%d, %s)", error, attempt, total, retrying)
            self._on_retry()
            fail(error, *count)  # type: ignore[call-arg]

        return super().call_with_retry(do, failed, retryable, with_failure_count)

    def __deepcopy__(self, memo: dict) -> _LoggingRetry:
        # redis-py copies the retry policy into every connection; ours holds a metrics callback (with a lock) that
        # must be shared, and the policy itself has no per-connection state.
        return self


class Lua:
    """A Lua script of the transport, declared as a class attribute and registered with an instance's client the
    first time that instance uses it (registering only computes its SHA; redis-py loads the script into Redis when a
    call finds it missing)."""

    def __init__(self, source: str):
        self.source = source
        self.slot = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_registered" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Script:
        script = obj.__dict__.get(self.slot)
        if script is None:
            script = obj.__dict__[self.slot] = obj.client.register_script(self.source)
        return cast(Script, script)


def _options(
    cfg: RedisConfig, on_reconnect: Callable[[], None]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The primary's credentials, its TLS files, and the options every connection takes (timeouts, retries)."""
    auth: dict[str, Any] = {}
    if cfg.username:
        auth["username"] = cfg.username
    if cfg.password:
        auth["password"] = cfg.password.get_secret_value()
    tls = {"ssl_ca_certs": cfg.tls_ca_file, "ssl_certfile": cfg.tls_cert_file, "ssl_keyfile": cfg.tls_key_file}
    tls = {k: v for k, v in tls.items() if v}  # rediss:// verifies the server's certificate by default
    common: dict[str, Any] = {
        **_timeouts(cfg),
        "health_check_interval": 30,
        "retry": _LoggingRetry(cfg.retries, cfg.backoff_max_s, on_reconnect),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
    }
    return auth, tls, common


def _timeouts(cfg: RedisConfig) -> dict[str, Any]:
    return {"socket_timeout": cfg.socket_timeout_s, "socket_connect_timeout": min(cfg.socket_timeout_s, 10.0)}


def is_sentinel_url(url: str) -> bool:
    return url.lower().startswith(("redis+sentinel://", "rediss+sentinel://"))


class Connection:
    """One process's connection to a run's keys: the base of every part of :class:`~common.transport.Transport`."""

    def __init__(
        self,
        cfg: RedisConfig,
        run: str,
        *,
        on_error: Callable[[], None] = lambda: None,
        on_reconnect: Callable[[], None] = lambda: None,
    ):
        if not cfg.url:
            raise TransportError("redis.url is empty: set it (or GRPO_REDIS_URL), or use `grpo run`")
        self.keys = Keys(run)
        self._cfg = cfg
        self._on_error = on_error
        self._sentinel: Sentinel | None = None
        try:
            pool = self._pool(cfg, on_reconnect)
        except ValueError as e:
            raise TransportError(f"redis.url {self.safe_url}: {e}") from None
        self.client = redis.Redis(connection_pool=pool)

    def _pool(self, cfg: RedisConfig, on_reconnect: Callable[[], None]) -> redis.ConnectionPool:
        auth, tls, common = _options(cfg, on_reconnect)
        if not is_sentinel_url(cfg.url):
            # The URL is parsed here rather than by from_url, where the URL's user and password would win over
            # the config's (which come from the environment or a secret, and must win).
            return redis.ConnectionPool(**(parse_url(cfg.url) | auth | tls), **common)
        s = parse_sentinel_url(cfg.url)
        ssl = {"ssl": True, **tls} if s.tls else {}
        # The URL's credentials are the sentinels'; the config's (environment, secret) the primary's,
        # which default to the URL's when unset.
        sentinel_auth = {k: v for k, v in (("username", s.username), ("password", s.password)) if v}
        sentinel = self._sentinel = Sentinel(s.hosts, sentinel_kwargs={**_timeouts(cfg), **sentinel_auth, **ssl})
        # Asked for the primary on every (re)connection: after a failover, the retry that follows the
        # lost connection (or the READONLY reply of a demoted primary) reaches the new one.
        return SentinelConnectionPool(s.service, sentinel, db=s.db, **(sentinel_auth | auth), **ssl, **common)

    def _do(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except redis.RedisError:
            self._on_error()
            raise

    def ping(self) -> None:
        """Raise :class:`TransportError` with a readable reason when the server cannot be used."""
        try:
            self._do(self.client.ping)
        except redis.AuthenticationError as e:
            raise TransportError(f"redis at {self.safe_url}: authentication failed ({e})") from None
        except redis.RedisError as e:
            raise TransportError(f"redis at {self.safe_url} is unreachable: {e}") from None

    @property
    def safe_url(self) -> str:
        from common.config import mask_url

        return mask_url(self._cfg.url)

    def close(self) -> None:
        self.client.close()
        self.client.connection_pool.disconnect()  # a pool passed in is not closed by the client
        for sentinel in self._sentinel.sentinels if self._sentinel is not None else []:
            sentinel.close()

    def server_time(self) -> float:
        """Redis's clock: one clock for every process of a run, whatever machine it is on."""
        seconds, micros = self._do(self.client.time)
        return seconds + micros / 1e6
