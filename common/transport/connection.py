"""The connection to Redis that every part of the transport (common.transport) shares: the URL (plain, TLS or
Sentinel), the bounded retry policies that log each attempt (a lost connection; a Redis that refuses commands for
now, such as a full one), the run's key names, and the Lua scripts' registration."""

from __future__ import annotations

import logging
import secrets
import time
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
from common.transport.refusals import Refusal, refusal, refusal_attempts, refusal_pause

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


def call_token() -> str:
    """A token of one call of a script that must not act twice when it is sent again after a lost reply (redis-py
    resends a call whose connection dropped, and Redis may have run it already); also of a round, in its claim
    (:class:`Rounds`)."""
    return secrets.token_hex(8)


class Rounds:
    """The token of each holder's round in this process, written into the round's claim by its first draw: further
    draws, the settling write and a release act on the claim only while it is still that round's. A holder name is
    not enough: a process started under the same name (a fixed ``actor.id``) while an earlier one was frozen past its
    lease holds a claim of that name too, and the earlier one, waking, would otherwise settle it with its own round
    (its positions sent again, the new round's never trained nor given back)."""

    def __init__(self) -> None:
        self._tokens: dict[str, str] = {}  # holder -> its round's token (threads draw for holders of their own)
        # The actor id this process draws under and its generation (``actor_ids``, :meth:`Drawing.take_name`): a
        # process whose id a newer one has taken since is refused its next draw (Superseded). '' and 0: none taken.
        self.name = ""
        self.generation = 0

    def start(self, holder: str) -> str:
        self._tokens[holder] = token = call_token()
        return token

    def of(self, holder: str) -> str:
        """The token of ``holder``'s round; '' where this process drew none for it (no claim is its)."""
        return self._tokens.get(holder, "")


class TransportError(RuntimeError):
    """Redis could not be reached (after the configured retries) or refused us; the message says which."""


class RedisUnavailable(redis.ConnectionError):
    """Redis refused a command for now (:func:`refusal`: full, busy ...) for longer than ``redis.full_wait_s``. A
    ConnectionError, so that a process stops on it as on a Redis it cannot reach (exit code 3, common.cli), in one
    line, for its supervisor to start it again; and no handler of a reply's error (``redis.ResponseError``: a key
    of the wrong type, a deleted stream, a lost lease) ever takes it for one of those."""


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
        self.prompts_claims = self.prefix + "prompts:claims"
        self.prompts_redraw = self.prefix + "prompts:redraw"
        self.prompts_trained = self.prefix + "prompts:trained"
        self.prompts_last = self.prefix + "prompts:last"
        self.actor_ids = self.prefix + "actor_ids"
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
    call finds it missing).

    A script that Redis refuses for now (full, busy: :func:`refusal`) is run again (:meth:`Connection._do`), which is
    safe only because a refusal ends a script before it wrote anything: so no script may catch the error of a write
    (``redis.pcall``) and go on writing."""

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
        self.rounds = Rounds()  # the prompt claims' rounds this process holds (common.transport.prompts)
        self._cfg = cfg
        self._refusal_attempts = refusal_attempts(cfg.full_wait_s, cfg.backoff_max_s)
        self._gave_up = False  # a call waited redis.full_wait_s in vain: the process stops (see _refused)
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
        """One call to Redis: ``fn`` sends it, anew each time it is called (a pipeline is built inside it, see
        :meth:`_batch`). A lost connection is retried by the connection's policy (redis-py's, ``redis.retries``); a
        reply saying Redis cannot serve the call now (:func:`refusal`: full, busy ...) is waited out here, each
        attempt logged ``attempt i/n`` with what to do, for up to ``redis.full_wait_s``; past it
        :class:`RedisUnavailable`. Every failed attempt counts as a Redis error (``on_error``).

        Sending a refused call again is safe, because Redis refused it before it changed anything, as
        tests/integration/test_redis_refusals.py checks against redis-server: a refused command did not run; a
        command refused while queued in MULTI makes Redis discard the whole transaction at EXEC (EXECABORT); and a
        Lua script is refused only at a write before which it wrote nothing (Redis checks OOM at a script's writes
        only while it has written nothing, so that a script that has written runs to its end; the other refusals'
        states cannot change while a script runs, so its first write meets them), and the refusal ends the
        script (see :class:`Lua`). Each call has the whole wait, as each has the reconnect attempts, until one has
        waited it in vain (:meth:`_refused`)."""
        attempts = self._refusal_attempts
        attempt = 0
        while True:
            try:
                return fn()
            except redis.RedisError as e:
                self._on_error()
                why = refusal(e)
                if why is None:
                    raise
                attempt += 1
                self._refused(why, attempt, attempts)

    def _refused(self, why: Refusal, attempt: int, attempts: int) -> None:
        """The ``attempt``-th of ``attempts`` at a call was refused: say so with what to do, and pause before the
        next; after the last, :class:`RedisUnavailable`. Once a call has given up, so does every call refused after
        it, at once: the process is stopping (exit code 3), and its other threads (a heartbeat, the lease's
        renewal) must not hold its exit up for another wait each."""
        if attempt >= attempts or self._gave_up:
            self._gave_up = True
            log.warning("redis: %s: %s (attempt %d/%d, giving up)", why.what, why.fix, attempt, attempts)
            raise RedisUnavailable(
                f"{why.what}, for redis.full_wait_s ({self._cfg.full_wait_s:g}s) at {self.safe_url}: {why.fix}"
            ) from None
        pause = refusal_pause(attempt, self._cfg.backoff_max_s)
        log.warning("redis: %s: %s (attempt %d/%d, waiting %.1fs; up to redis.full_wait_s %gs)", why.what, why.fix,
                    attempt, attempts, pause, self._cfg.full_wait_s)  # fmt: skip
        time.sleep(pause)

    def _batch(self, build: Callable[[Any], object], *, transaction: bool) -> list[Any]:
        """Commands sent together as one call (:meth:`_do`), in one MULTI/EXEC with ``transaction`` (their replies of
        the same instant): ``build`` queues them on a pipeline built anew for each attempt (redis-py empties a
        pipeline once it has run, whatever became of it). Without a transaction, the commands before a refused one
        did run and are sent again: such a batch holds reads alone."""

        def send() -> list[Any]:
            pipe = self.client.pipeline(transaction=transaction)
            build(pipe)
            return cast(list[Any], pipe.execute())

        return self._do(send)

    def ping(self) -> None:
        """Raise :class:`TransportError` with a readable reason when the server cannot be used."""
        try:
            self._do(self.client.ping)
        except RedisUnavailable:
            raise  # reached, but refusing commands for too long: as mid-run (exit code 3)
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
