"""The Redis side of the pipeline: key names, the groups stream, dead letters, weights announcements, counters.

Keys (all under ``grpo:{<run>}:``; the braces are a Redis Cluster hash tag, so a run's keys share one slot):

=====================  ==========  ======================================================================
``groups``             stream      scored groups, consumer group ``learners``; field ``data`` = msgpack
``dead``               stream      rejected messages: ``reason``, ``payload`` (raw bytes), ``source_id``
``weights:latest``     hash        ``version``, ``uri``, ``digest``, ``format``, ``published_at``
``weights``            channel     pub/sub: the new version number, published with the hash update
``prompts:cursor``     counter     shared by actors so replicas do not repeat prompts
``actors:<id>``        string+TTL  heartbeat (JSON: version, pid, groups sent)
``stats``              hash        durable counters, see below
``done``               string      set by the learner after its last step; actors exit when they see it
``trained_ids``        sorted set  group ids trained on, by step (a bounded window), to train a duplicate once
``inflight``           hash        rounds actors are sampling: actor id -> ``<groups> <lease end, ms of Redis's clock>``
``filtered``           hash        running sums over the groups actors filtered out (``groups``, ``zero_std_groups``,
                                   ``completions``, ``reward_sum``, ``reward_std_sum``): the learner's reward figures
``identity``           hash        the run's identity (``id``, ``created_at``), also in every checkpoint; and what a
                                   Redis that lost its data lost (``resets``, ``reset_at``, ``reset_step``,
                                   ``trained_before_reset``: groups trained before the loss, not in ``stats``)
=====================  ==========  ======================================================================

Accounting. Every counter in ``stats`` is bumped in the same MULTI/EXEC transaction as the stream operation it
counts, so a crash can never separate the two:

    groups_produced = groups_trained + Σ groups_dropped:<reason> + groups_dead + XLEN(groups)

The learner deletes (XDEL) each entry in the transaction that acknowledges it, so the stream only ever holds
groups that are unread or pending; actors bound the unread ones with backpressure (checked in the script that
writes them), never with MAXLEN (trimming could drop a group nobody has trained on). Groups an actor filters out
never enter the stream and are counted apart as ``groups_filtered:<reason>``.

Room is reserved before sampling (``inflight``, :meth:`Transport.reserve_round`): an actor samples a round only while
the groups ahead of it (unread, plus rounds other actors are sampling) and the round itself can be trained before they
pass ``max_staleness``, so that generation is not spent on groups the learner will drop as stale.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.connection import parse_url
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from common.config import Config, RedisConfig
from common.metrics import DropReason
from common.schemas import FilteredStats, WeightsAnnouncement, as_text

log = logging.getLogger(__name__)

CONSUMER_GROUP = "learners"
_SCRIPT_CHUNK = 1000  # ids per script call (Lua's unpack has a stack limit)

# Remove a hash field only if it still holds the value read: a member that re-registered meanwhile stays.
_HDEL_IF = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""

# Settling a group (trained, dropped, dead) is one Lua script, atomic like MULTI/EXEC, and idempotent: a command
# retried after its reply was lost finds the entry already deleted and counts nothing twice, so the equation holds.
_SETTLE = """
redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 3))
local deleted = redis.call('XDEL', KEYS[1], unpack(ARGV, 3))
if deleted > 0 then redis.call('HINCRBY', KEYS[2], ARGV[2], deleted) end
return deleted
"""
# Trained groups are also remembered by group id (scored by learner step, the oldest forgotten), so a group delivered
# twice (an actor's write retried after a lost reply) is recognised and trained once.
_SETTLE_TRAINED = """
local n = tonumber(ARGV[4])
local ids = {unpack(ARGV, 5, 4 + n)}
redis.call('XACK', KEYS[1], ARGV[1], unpack(ids))
local deleted = redis.call('XDEL', KEYS[1], unpack(ids))
if deleted > 0 then redis.call('HINCRBY', KEYS[2], 'groups_trained', deleted) end
for i = 5 + n, #ARGV do redis.call('ZADD', KEYS[3], ARGV[2], ARGV[i]) end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[3])
return deleted
"""
# Unread entries: XLEN minus the consumer group's pending count (no group yet: all of them).
_UNREAD_LUA = """
local function unread(stream, group)
  local n = redis.call('XLEN', stream)
  local ok, info = pcall(redis.call, 'XPENDING', stream, group)
  if ok and info then n = n - info[1] end
  return n
end
"""
_UNREAD = _UNREAD_LUA + "return unread(KEYS[1], ARGV[1])"
_PRODUCE = (
    _UNREAD_LUA
    + """
local ncount = tonumber(ARGV[4])
local nsums = tonumber(ARGV[5])
local first = 7 + 2 * ncount + 2 * nsums
local npay = #ARGV - first + 1
local bound = tonumber(ARGV[2])
local most = tonumber(ARGV[6])
for i = first, #ARGV do
  if most >= 0 and #ARGV[i] > most then
    return redis.error_reply('oversized: a message of ' .. #ARGV[i] .. ' bytes, over the limit of ' .. most)
  end
end
if npay > 0 and bound >= 0 then
  local waiting = unread(KEYS[1], ARGV[1])
  if waiting > 0 and waiting + npay > bound then return false end  -- round_fits(), the rule actors wait on
end
local ids = {}
for i = first, #ARGV do ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'data', ARGV[i]) end
if npay > 0 then redis.call('HINCRBY', KEYS[2], 'groups_produced', npay) end
for i = 0, ncount - 1 do redis.call('HINCRBY', KEYS[2], ARGV[7 + 2 * i], ARGV[8 + 2 * i]) end
for i = 0, nsums - 1 do
  redis.call('HINCRBYFLOAT', KEYS[4], ARGV[7 + 2 * ncount + 2 * i], ARGV[8 + 2 * ncount + 2 * i])
end
if ARGV[3] ~= '' then redis.call('HDEL', KEYS[3], ARGV[3]) end  -- the round is in: its reservation ends
return ids
"""
)
# Reserve room for a round an actor is about to sample (see Admission). Reservations are leases on Redis's clock,
# renewed by the actor's heartbeat: a killed actor's expires and is removed here.
_RESERVE = (
    _UNREAD_LUA
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local reserved = 0
local held = redis.call('HGETALL', KEYS[2])
for i = 1, #held, 2 do
  local n, lease_end = string.match(held[i + 1], '^(%d+) (%d+)$')
  if n == nil or tonumber(lease_end) <= now then redis.call('HDEL', KEYS[2], held[i])
  elseif held[i] ~= ARGV[2] then reserved = reserved + tonumber(n) end
end
local ahead = unread(KEYS[1], ARGV[1]) + reserved
local need = tonumber(ARGV[3])
local limit = tonumber(ARGV[4])
local announced = tonumber(redis.call('HGET', KEYS[3], 'version') or '')
if announced ~= nil then
  local lag = math.max(0, announced + tonumber(ARGV[8]) - tonumber(ARGV[7]))
  limit = math.min(limit, tonumber(ARGV[5]) * (tonumber(ARGV[6]) + 1 - lag))
end
if ahead > 0 and ahead + need > limit then  -- round_fits(ahead, need, limit)
  redis.call('HDEL', KEYS[2], ARGV[2])
  return 0
end
redis.call('HSET', KEYS[2], ARGV[2], need .. ' ' .. (now + tonumber(ARGV[9])))
return 1
"""
)
_RENEW = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n = string.match(v, '^(%d+) ') or '0'
redis.call('HSET', KEYS[1], ARGV[1], n .. ' ' .. (now + tonumber(ARGV[2])))
return 1
"""
_DEAD_LETTER = """
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if redis.call('XDEL', KEYS[1], ARGV[2]) == 0 then return 0 end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'reason', ARGV[3], 'payload', ARGV[4], 'source_id', ARGV[2],
           'at', ARGV[5], 'size', #ARGV[4])
redis.call('HINCRBY', KEYS[2], 'groups_dead', 1)
return 1
"""
# Deliver entries to the learner, bounded in bytes, without an oversized one ever leaving Redis: it is dead-lettered
# here (its first ARGV[7] bytes kept, marked truncated). Mode 'new' reads new entries one at a time (XREADGROUP);
# mode 'ids' fetches entries already pending for this consumer (ARGV[10...]), one id at a time. It stops after
# ARGV[3] entries examined (returned or dead) or once those returned hold ARGV[5] bytes; it returns how many ids it
# dealt with, the dead-lettered ids and reasons, and the entries.
_DELIVER = """
local count, most, budget = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local out, dead, bytes, taken = {}, {}, 0, 0
local function take(id, fields)
  local data
  for i = 1, #fields, 2 do if fields[i] == 'data' then data = fields[i + 1] end end
  local size = data and #data or 0
  if size <= most then
    out[#out + 1] = {id, fields}
    bytes = bytes + size
    return
  end
  local reason = 'oversized: ' .. size .. ' bytes, over the limit of ' .. most .. ' (redis.max_message_bytes)'
  redis.call('XACK', KEYS[1], ARGV[1], id)
  redis.call('XDEL', KEYS[1], id)
  local prefix = string.sub(data, 1, tonumber(ARGV[7]))
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'reason', reason, 'payload', prefix, 'source_id', id,
             'at', ARGV[8], 'size', size, 'truncated', '1')
  redis.call('HINCRBY', KEYS[2], 'groups_dead', 1)
  dead[#dead + 1] = id
  dead[#dead + 1] = reason
end
if ARGV[9] == 'new' then
  while taken < count and bytes < budget do
    local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1, 'STREAMS', KEYS[1], '>')
    if not r then break end
    local e = r[1][2][1]
    take(e[1], e[2])
    taken = taken + 1
  end
else
  for i = 10, #ARGV do
    if #out >= count or bytes >= budget then break end
    local e = redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])
    if #e == 0 then redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) else take(e[1][1], e[1][2]) end  -- gone: settled
    taken = taken + 1
  end
end
return {taken, dead, out}
"""
_CLAIM_IDS = "return redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', 256, 'JUSTID')"
# Replay: the dead letter goes back into the groups stream as a newly produced group (so the equation still holds:
# it was counted dead once, and is now counted produced once more) and leaves the dead stream, in one step.
_REPLAY = """
local e = redis.call('XRANGE', KEYS[3], ARGV[1], ARGV[1])
if #e == 0 then return false end
local fields = e[1][2]
local payload
local truncated
for i = 1, #fields, 2 do
  if fields[i] == 'payload' then payload = fields[i + 1] end
  if fields[i] == 'truncated' then truncated = fields[i + 1] end
end
if payload == nil then return false end
if truncated == '1' then return redis.error_reply('TRUNCATED the dead letter holds only a prefix of its message') end
local id = redis.call('XADD', KEYS[1], '*', 'data', payload)
redis.call('HINCRBY', KEYS[2], 'groups_produced', 1)
redis.call('HINCRBY', KEYS[2], 'groups_replayed', 1)
redis.call('XDEL', KEYS[3], ARGV[1])
return id
"""
T = TypeVar("T")
DEAD_PREFIX_BYTES = 4096  # what the dead stream keeps of an oversized message: enough to see what it was


class MessageTooLarge(ValueError):
    """A group message over ``redis.max_message_bytes``: refused by the script that writes, nothing written."""


def message_byte_limit(cfg: Config) -> int:
    """``redis.max_message_bytes``, or (0) twice the largest valid group of this run on the wire, plus 64 KiB: a
    prompt as long as the model's positions (or ``task.max_prompt_tokens``; 32,768 tokens when neither says) and
    ``group_size`` completions of ``sampling.max_new_tokens``, at 12 bytes a token (a 4-byte id and an 8-byte
    log-prob, the widest the schema takes) and 64 bytes a completion. Actors and the learner derive the same."""
    if cfg.redis.max_message_bytes:
        return cfg.redis.max_message_bytes
    prompt = cfg.task.max_prompt_tokens or _positions(cfg.model.path) or 32_768
    g = cfg.sampling.group_size
    return 2 * (12 * (prompt + g * cfg.sampling.max_new_tokens) + 64 * g) + 64 * 1024


def _positions(path: str) -> int | None:
    from common.models import max_positions

    try:
        return max_positions(path)
    except Exception:  # not a model directory this process can read (an SGLang actor's server-side path)
        return None


@dataclass(frozen=True)
class ReadLimits:
    """What one delivery to the learner may load: an entry over ``max_bytes`` is dead-lettered inside Redis (its
    first ``DEAD_PREFIX_BYTES`` kept) and never returned; a delivery stops once its entries hold ``budget_bytes``
    (at least one entry is returned). ``dead_keep``: about how many entries the dead stream keeps."""

    max_bytes: int
    budget_bytes: int
    dead_keep: int = 100_000


def round_fits(unread: int, size: int, bound: int) -> bool:
    """The write script's admission rule (``_PRODUCE`` checks the same): a round of ``size`` groups fits while the
    unread ones plus it stay within ``bound``, and any round fits an empty stream (one larger than the bound must
    still go somewhere). Actors wait on this very rule, so a round the script refuses is one they wait for."""
    return unread == 0 or unread + size <= bound


@dataclass(frozen=True)
class Admission:
    """How much actors may have ahead of the learner (:meth:`Transport.reserve_round`): at most ``bound`` unread
    groups (``actor.max_stream_groups``), and no more than the learner can train before they pass ``max_staleness``.
    The learner trains ``batch_groups`` a step and its version grows by one a step, so a round sampled with version
    v, behind ``ahead`` groups, is trained by version A + ⌈(ahead + round) / batch_groups⌉ − 1, where A is the
    learner's version: the announced one plus up to ``versions_ahead`` (``learner.publish_every`` − 1)."""

    bound: int
    batch_groups: int
    max_staleness: int
    versions_ahead: int = 0


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
        self.stats = self.prefix + "stats"
        self.done = self.prefix + "done"
        self.trained_ids = self.prefix + "trained_ids"
        self.inflight = self.prefix + "inflight"
        self.filtered = self.prefix + "filtered"
        self.identity = self.prefix + "identity"
        self.nccl_members = self.prefix + "nccl:members"
        self.nccl_round = self.prefix + "nccl:round"
        self.nccl_ready = self.prefix + "nccl:ready"
        self.nccl_state = self.prefix + "nccl:state"

    def actor(self, actor_id: str) -> str:
        return f"{self.prefix}actors:{actor_id}"


@dataclass(frozen=True)
class StreamEntry:
    id: str
    fields: dict[bytes, bytes]

    @property
    def payload(self) -> bytes | None:
        return self.fields.get(b"data")


class Delivery(list[StreamEntry]):
    """Entries delivered to a learner (the list), with the (id, reason) of each oversized one dead-lettered on the
    way (``dead``) and how many of the ids asked for were dealt with (``taken``, :meth:`Transport.fetch`)."""

    def __init__(self, entries: Iterable[StreamEntry], dead: list[tuple[str, str]], taken: int = 0):
        super().__init__(entries)
        self.dead = dead
        self.taken = taken


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


class Transport:
    """One process's connection to a run's keys. Thin: each method is a command, a transaction or a script."""

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
        auth: dict[str, Any] = {}
        if cfg.username:
            auth["username"] = cfg.username
        if cfg.password:
            auth["password"] = cfg.password.get_secret_value()
        tls = {"ssl_ca_certs": cfg.tls_ca_file, "ssl_certfile": cfg.tls_cert_file, "ssl_keyfile": cfg.tls_key_file}
        tls = {k: v for k, v in tls.items() if v}  # rediss:// verifies the server's certificate by default
        timeouts: dict[str, Any] = {
            "socket_timeout": cfg.socket_timeout_s,
            "socket_connect_timeout": min(cfg.socket_timeout_s, 10.0),
        }
        common: dict[str, Any] = {
            **timeouts,
            "health_check_interval": 30,
            "retry": _LoggingRetry(cfg.retries, cfg.backoff_max_s, on_reconnect),
            "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
        }
        pool: redis.ConnectionPool
        self._sentinel: Sentinel | None = None
        try:
            if cfg.url.lower().startswith(("redis+sentinel://", "rediss+sentinel://")):
                s = parse_sentinel_url(cfg.url)
                ssl = {"ssl": True, **tls} if s.tls else {}
                # The URL's credentials are the sentinels'; the config's (environment, secret) the primary's,
                # which default to the URL's when unset.
                sentinel_auth = {k: v for k, v in (("username", s.username), ("password", s.password)) if v}
                sentinel = self._sentinel = Sentinel(s.hosts, sentinel_kwargs={**timeouts, **sentinel_auth, **ssl})
                # Asked for the primary on every (re)connection: after a failover, the retry that follows the
                # lost connection (or the READONLY reply of a demoted primary) reaches the new one.
                pool = SentinelConnectionPool(s.service, sentinel, db=s.db, **(sentinel_auth | auth), **ssl, **common)
            else:
                # The URL is parsed here rather than by from_url, where the URL's user and password would win over
                # the config's (which come from the environment or a secret, and must win).
                pool = redis.ConnectionPool(**(parse_url(cfg.url) | auth | tls), **common)
        except ValueError as e:
            raise TransportError(f"redis.url {self.safe_url}: {e}") from None
        self.client = redis.Redis(connection_pool=pool)
        self._settle_script = self.client.register_script(_SETTLE)
        self._settle_trained_script = self.client.register_script(_SETTLE_TRAINED)
        self._produce_script = self.client.register_script(_PRODUCE)
        self._reserve_script = self.client.register_script(_RESERVE)
        self._renew_script = self.client.register_script(_RENEW)
        self._unread_script = self.client.register_script(_UNREAD)
        self._dead_script = self.client.register_script(_DEAD_LETTER)
        self._deliver_script = self.client.register_script(_DELIVER)
        self._claim_ids_script = self.client.register_script(_CLAIM_IDS)
        self._replay_script = self.client.register_script(_REPLAY)
        self._hdel_if_script = self.client.register_script(_HDEL_IF)

    # -- plumbing ---------------------------------------------------------------------------------------------

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

    # -- groups stream: actors --------------------------------------------------------------------------------

    def produce(
        self,
        payloads: list[bytes],
        counters: dict[str, int] | None = None,
        *,
        bound: int | None = None,
        holder: str = "",
        filtered: FilteredStats | None = None,
        max_bytes: int | None = None,
    ) -> list[str] | None:
        """XADD groups and count them as produced, atomically: all of them or none.

        ``counters`` are other ``stats`` increments of the same round, such as ``groups_filtered:zero_std`` for
        groups that were sampled and not sent (they never enter the stream). With ``bound``, nothing is written and
        None is returned when the stream's unread groups plus these would exceed it (a round always fits an empty
        stream): the check and the writes are one script, so many actors together never overshoot the bound.
        Written, the round ends ``holder``'s reservation (:meth:`reserve_round`). ``filtered`` summarises the
        round's groups that were sampled and filtered out: added to the ``filtered`` hash in the same script, so the
        learner's reward figures count them whatever becomes of the groups sent. A payload over ``max_bytes`` makes
        the script refuse the whole call (:class:`MessageTooLarge`), writing nothing."""
        counters = {k: n for k, n in (counters or {}).items() if n}
        sums = filtered.fields() if filtered is not None and filtered.groups else {}
        if not payloads and not counters and not sums:
            return []
        args: list[Any] = [CONSUMER_GROUP, -1 if bound is None else bound, holder, len(counters), len(sums)]
        args.append(-1 if max_bytes is None else max_bytes)
        for name, n in [*counters.items(), *sums.items()]:
            args += [name, repr(n) if isinstance(n, float) else n]
        keys = [self.keys.groups, self.keys.stats, self.keys.inflight, self.keys.filtered]
        try:
            reply = self._do(lambda: self._produce_script(keys=keys, args=[*args, *payloads]))
        except redis.ResponseError as e:
            if "oversized" in str(e):
                raise MessageTooLarge(str(e).split("oversized: ", 1)[-1]) from None
            raise
        return None if reply is None else [as_text(i) for i in reply]

    def reserve_round(self, holder: str, groups: int, version: int, admission: Admission, lease_s: float) -> bool:
        """Reserve room for a round of ``groups`` that ``holder`` is about to sample with policy ``version``; False
        (and no reservation) when the groups ahead of it (unread, and the rounds others reserved) plus the round
        would pass ``admission.bound`` or could not all be trained within ``max_staleness`` (see
        :class:`Admission`); any round may enter an empty pipeline. One script: actors never overbook together.
        The reservation lasts ``lease_s`` (renewed by :meth:`renew_reservation`) and ends when its round is written
        or the actor releases it."""
        a = admission
        lease_ms = max(1, int(lease_s * 1000))
        args: list[Any] = [CONSUMER_GROUP, holder, groups, a.bound, a.batch_groups, a.max_staleness, version,
                           a.versions_ahead, lease_ms]  # fmt: skip
        keys = [self.keys.groups, self.keys.inflight, self.keys.weights_latest]
        return bool(self._do(lambda: self._reserve_script(keys=keys, args=args)))

    def renew_reservation(self, holder: str, lease_s: float) -> None:
        """Extend ``holder``'s reservation, if it has one, by ``lease_s`` from now (with each heartbeat)."""
        lease_ms = max(1, int(lease_s * 1000))
        self._do(lambda: self._renew_script(keys=[self.keys.inflight], args=[holder, lease_ms]))

    def release_round(self, holder: str) -> None:
        """Give up ``holder``'s reservation (a round it will not send)."""
        self._do(lambda: self.client.hdel(self.keys.inflight, holder))

    def filtered_totals(self) -> FilteredStats:
        """The running sums over every group actors filtered out (see :meth:`produce`)."""
        h = self._do(lambda: self.client.hgetall(self.keys.filtered))
        return FilteredStats.from_fields({as_text(k): float(v) for k, v in h.items()})

    def stream_length(self) -> int:
        return int(self._do(lambda: self.client.xlen(self.keys.groups)))

    def unread(self) -> int:
        """Groups in the stream that no learner has read yet (its length minus the pending entries)."""
        return int(self._do(lambda: self._unread_script(keys=[self.keys.groups], args=[CONSUMER_GROUP])))

    def next_prompts(self, k: int) -> range:
        """Claim ``k`` consecutive prompt positions from the shared cursor (positions, not dataset indices)."""
        end = int(self._do(lambda: self.client.incrby(self.keys.prompts_cursor, k)))
        return range(end - k, end)

    def heartbeat(self, actor_id: str, ttl_s: float, info: dict[str, Any]) -> None:
        body = json.dumps({"pid": os.getpid(), "at": time.time(), **info})
        self._do(lambda: self.client.set(self.keys.actor(actor_id), body, px=max(1, int(ttl_s * 1000))))

    def live_actors(self) -> dict[str, dict[str, Any]]:
        """Heartbeats of the actors whose key has not expired, by actor id."""
        keys = self._do(lambda: list(self.client.scan_iter(match=self.keys.actor("*"), count=100)))
        values = self._do(lambda: self.client.mget(keys)) if keys else []
        return {
            as_text(k).rsplit(":", 1)[-1]: json.loads(v) for k, v in zip(keys, values, strict=True) if v is not None
        }

    # -- groups stream: learner -------------------------------------------------------------------------------

    def ensure_consumer_group(self) -> None:
        """Create the stream and the ``learners`` group, reading from the very first entry (id 0): groups that
        actors XADD before the learner first starts are trained, not skipped."""
        try:
            self._do(lambda: self.client.xgroup_create(self.keys.groups, CONSUMER_GROUP, id="0", mkstream=True))
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def read(self, consumer: str, count: int, block_ms: int, limits: ReadLimits | None = None) -> Delivery:
        """Up to ``count`` new entries for this consumer, waiting up to ``block_ms`` for the first; they stay
        pending until settled (see :meth:`stranded` for pending ones the consumer never saw). Within ``limits``
        (none: unbounded), as :data:`_DELIVER` reads them: oversized entries are dead-lettered inside Redis, and the
        delivery stops at the byte budget. Waiting polls every 20 ms (a blocking XREADGROUP would hand over an
        entry whatever its size)."""
        deadline = time.monotonic() + block_ms / 1000
        while True:
            got = self._deliver("new", consumer, count, limits, [])
            left = deadline - time.monotonic()
            if got or got.dead or left <= 0:
                return got
            time.sleep(min(0.02, left))

    def fetch(self, consumer: str, ids: list[str], count: int, limits: ReadLimits | None = None) -> Delivery:
        """Entries already pending for ``consumer`` (from :meth:`stranded`), in order, within ``limits`` like
        :meth:`read`; ``taken`` says how many of ``ids`` were dealt with (returned, dead-lettered, or found
        settled already)."""
        return self._deliver("ids", consumer, count, limits, ids[: max(count, 1) * 4])

    def _deliver(self, mode: str, consumer: str, count: int, limits: ReadLimits | None, ids: list[str]) -> Delivery:
        lim = limits or ReadLimits(2**62, 2**62)
        args: list[Any] = [CONSUMER_GROUP, consumer, count, lim.max_bytes, lim.budget_bytes, lim.dead_keep,
                           DEAD_PREFIX_BYTES, repr(time.time()), mode, *ids]  # fmt: skip
        keys = [self.keys.groups, self.keys.stats, self.keys.dead]
        taken, dead, entries = cast(Any, self._do(lambda: self._deliver_script(keys=keys, args=args)))
        return Delivery(
            [StreamEntry(as_text(i), dict(zip(f[::2], f[1::2], strict=True))) for i, f in entries],
            [(as_text(dead[k]), as_text(dead[k + 1])) for k in range(0, len(dead), 2)],
            int(taken),
        )

    def claim_pending(self, consumer: str, min_idle_ms: int = 0) -> list[str]:
        """Take over entries another (dead) learner read but never acked (XAUTOCLAIM JUSTID, 256 a page): their
        ids, oldest first; no payload is loaded (:meth:`stranded` lists them, :meth:`fetch` reads them in pages)."""
        out: list[str] = []
        start = "0-0"
        while True:
            # A script, because redis-py's XAUTOCLAIM ... JUSTID drops the cursor from its reply.
            args = [CONSUMER_GROUP, consumer, min_idle_ms, start]
            reply: Any = self._do(lambda a=args: self._claim_ids_script(keys=[self.keys.groups], args=a))  # type: ignore[misc]
            start = as_text(reply[0])
            out.extend(as_text(i) for i in reply[1])
            if start == "0-0":
                return out

    def stranded(self, consumer: str, known: set[str]) -> list[str]:
        """Ids of entries pending for ``consumer`` that it does not know it holds: taken over from a dead learner,
        or delivered by a read whose reply was lost (:meth:`fetch` reads them in pages). Costs one XPENDING summary
        when there are none (the usual case)."""
        summary: Any = self._do(lambda: self.client.xpending(self.keys.groups, CONSUMER_GROUP))
        ours = sum(int(c["pending"]) for c in summary.get("consumers") or [] if as_text(c["name"]) == consumer)
        if ours <= len(known):
            return []
        ids: list[str] = []
        start = "-"
        while True:
            page: Any = self._do(
                lambda s=start: self.client.xpending_range(  # type: ignore[misc]
                    self.keys.groups, CONSUMER_GROUP, min=s, max="+", count=1000, consumername=consumer
                )
            )
            ids += [i for p in page if (i := as_text(p["message_id"])) not in known]
            if len(page) < 1000:
                break
            start = "(" + as_text(page[-1]["message_id"])
        return ids

    def _settle(self, ids: list[str], counter: str) -> None:
        for i in range(0, len(ids), _SCRIPT_CHUNK):
            self._do(lambda c=ids[i : i + _SCRIPT_CHUNK]: self._settle_script(  # type: ignore[misc]
                keys=[self.keys.groups, self.keys.stats], args=[CONSUMER_GROUP, counter, *c]
            ))  # fmt: skip

    def ack_trained(self, ids: list[str], group_ids: list[str], step: int = 0, window: int = 1000) -> None:
        """After the optimizer step that used them (and the checkpoint that covers it): XACK + XDEL +
        groups_trained, and remember the group ids for ``window`` steps, atomically."""
        for i in range(0, len(ids), _SCRIPT_CHUNK):
            part, gids = ids[i : i + _SCRIPT_CHUNK], group_ids[i : i + _SCRIPT_CHUNK]
            self._do(
                lambda p=part, g=gids: self._settle_trained_script(  # type: ignore[misc]
                    keys=[self.keys.groups, self.keys.stats, self.keys.trained_ids],
                    args=[CONSUMER_GROUP, step, step - window, len(p), *p, *g],
                )
            )

    def trained_before(self, group_ids: list[str]) -> list[bool]:
        """Whether each group id was trained on already (within the remembered window)."""
        if not group_ids:
            return []
        scores = self._do(lambda: self.client.zmscore(self.keys.trained_ids, group_ids))
        return [s is not None for s in scores]

    def drop(self, ids: list[str], reason: DropReason) -> None:
        """Groups the learner refuses (e.g. too stale): XACK + XDEL + groups_dropped:<reason>, atomically."""
        self._settle(ids, f"groups_dropped:{reason}")

    def dead_letter(self, entry: StreamEntry, reason: str, keep: int = 100_000) -> None:
        """Move a message that failed to decode or validate to the ``dead`` stream, with its reason, raw bytes and
        size (an oversized one never gets here: :meth:`read` dead-letters it with a prefix). The stream keeps about
        the newest ``keep`` (a flood of garbage must not fill Redis); ``groups_dead`` counts every one."""
        payload = entry.payload if entry.payload is not None else b""
        self._do(
            lambda: self._dead_script(
                keys=[self.keys.groups, self.keys.stats, self.keys.dead],
                args=[CONSUMER_GROUP, entry.id, reason[:1000], payload, repr(time.time()), keep],
            )
        )

    def dead_letters(self, count: int, start: str = "-") -> list[StreamEntry]:
        """The oldest ``count`` dead letters from ``start`` (fields: reason, payload, source_id, at, size, and
        ``truncated`` when the payload is only the first ``DEAD_PREFIX_BYTES`` of an oversized message)."""
        reply: Any = self._do(lambda: self.client.xrange(self.keys.dead, min=start, count=count))
        return [StreamEntry(as_text(i), f) for i, f in reply]

    def dead_letter_count(self) -> int:
        return int(self._do(lambda: self.client.xlen(self.keys.dead)))

    def replay_dead(self, dead_id: str) -> str | None:
        """Put a dead letter's payload back into the groups stream (counted as produced and as
        ``groups_replayed``) and remove it from the dead stream, atomically. None if there is no such entry;
        :class:`ValueError` if it holds only a prefix of an oversized message (it stays where it is)."""
        keys = [self.keys.groups, self.keys.stats, self.keys.dead]
        try:
            reply = self._do(lambda: self._replay_script(keys=keys, args=[dead_id]))
        except redis.ResponseError as e:
            if "TRUNCATED" in str(e):
                raise ValueError(f"it holds only the first {DEAD_PREFIX_BYTES} bytes of an oversized message: it "
                                 "cannot be replayed") from None  # fmt: skip
            raise
        return None if reply is None else as_text(reply)

    # -- weights ----------------------------------------------------------------------------------------------

    def announce_weights(self, ann: WeightsAnnouncement) -> None:
        """Update ``weights:latest`` and publish the version on the ``weights`` channel, atomically."""
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.keys.weights_latest)  # no field of an earlier build's announcement outlives it
        pipe.hset(self.keys.weights_latest, mapping=cast(Any, ann.to_hash()))
        pipe.publish(self.keys.weights_channel, str(ann.version))
        self._do(pipe.execute)

    def latest_weights(self) -> WeightsAnnouncement | None:
        """The announced version; None when none is; SchemaError (one line) when the hash is malformed: every
        reader treats that as bad input, and the learner's next announcement replaces it."""
        h = self._do(lambda: self.client.hgetall(self.keys.weights_latest))
        return WeightsAnnouncement.from_hash(h) if h else None

    def subscribe_weights(self) -> redis.client.PubSub:
        ps = self.client.pubsub(ignore_subscribe_messages=True)
        ps.subscribe(self.keys.weights_channel)
        return ps

    # -- weights over NCCL (common.weight_sync) ----------------------------------------------------------------

    def nccl_register(self, member: str, info: dict[str, Any]) -> None:
        """An actor whose engine can take weights over NCCL says so (again every heartbeat and whenever it joins or
        leaves a group): ``info`` holds its server's ``ranks``, a ``nonce`` of its process and the ``group`` it is
        in. Stamped with Redis's clock, so that a machine's skewed clock cannot age it out."""
        body = json.dumps({**info, "at": self.server_time()})
        self._do(lambda: self.client.hset(self.keys.nccl_members, member, body))

    def nccl_unregister(self, member: str) -> None:
        self._do(lambda: self.client.hdel(self.keys.nccl_members, member))

    def nccl_members(self, max_age_s: float) -> dict[str, dict[str, Any]]:
        """Members registered in the last ``max_age_s``, id -> what they registered; older entries (an actor killed
        before it could unregister) are removed, unless re-registered meanwhile."""
        now = self.server_time()
        members: dict[str, dict[str, Any]] = {}
        for k, v in self._do(lambda: self.client.hgetall(self.keys.nccl_members)).items():
            try:
                d = json.loads(v)
                fresh = now - float(d["at"]) <= max_age_s and int(d["ranks"]) > 0
            except (ValueError, KeyError, TypeError):
                fresh = False
            if fresh:
                members[as_text(k)] = d
            else:
                self._hdel_if(self.keys.nccl_members, k, v)
        return members

    def _hdel_if(self, key: str, field: Any, value: Any) -> None:
        self._do(lambda: self._hdel_if_script(keys=[key], args=[field, value]))

    def nccl_open_round(self, round_json: str) -> None:
        """Start a round: its description, no one ready yet, no decision (members poll for it)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.keys.nccl_ready, self.keys.nccl_state)
        pipe.set(self.keys.nccl_round, round_json)
        self._do(pipe.execute)

    def nccl_round(self) -> bytes | None:
        return cast("bytes | None", self._do(lambda: self.client.get(self.keys.nccl_round)))

    def nccl_ready(self, round_id: str, member: str) -> None:
        """``round_id``: the learner's session and the round's sequence number, ``<session>:<seq>``."""
        self._do(lambda: self.client.hset(self.keys.nccl_ready, member, round_id))

    def nccl_ready_members(self, round_id: str) -> set[str]:
        ready = self._do(lambda: self.client.hgetall(self.keys.nccl_ready))
        return {as_text(k) for k, v in ready.items() if as_text(v) == round_id}

    def nccl_decide(self, round_id: str, decision: str) -> None:
        """``join`` (members join the round's new group), ``go`` (the learner broadcasts now) or ``cancel`` (it does
        not: the version goes to disk)."""
        self._do(lambda: self.client.set(self.keys.nccl_state, f"{round_id}:{decision}"))

    def nccl_decision(self, round_id: str) -> str | None:
        """The decision on round ``round_id``; ``cancel`` once the state belongs to any other round (a later one, or
        another learner's), None while undecided."""
        value, state = self._do(lambda: self.client.mget(self.keys.nccl_round, self.keys.nccl_state))
        if state is not None:
            at, _, decision = as_text(state).rpartition(":")
            if at == round_id:
                return decision
        if value is None:
            return "cancel"
        try:
            current = json.loads(value)
            current_id = f"{current['session']}:{current['seq']}"
        except (ValueError, KeyError, TypeError):
            return "cancel"
        return None if current_id == round_id else "cancel"

    # -- run state and counters -------------------------------------------------------------------------------

    def server_time(self) -> float:
        """Redis's clock: one clock for every process of a run, whatever machine it is on."""
        seconds, micros = self._do(self.client.time)
        return seconds + micros / 1e6

    def mark_done(self) -> None:
        self._do(lambda: self.client.set(self.keys.done, repr(self.server_time())))

    def clear_done(self) -> None:
        self._do(lambda: self.client.delete(self.keys.done))

    def is_done(self) -> bool:
        """Whether the learner marked the run finished. A run name is one run: an actor that starts (or restarts)
        after the mark exits at once, and a learner resuming a run clears the mark while it trains."""
        return bool(self._do(lambda: self.client.exists(self.keys.done)))

    def identity(self) -> dict[str, str]:
        """The run's identity hash; empty when Redis holds none (a new run, or a Redis that lost its data)."""
        return {as_text(k): as_text(v) for k, v in self._do(lambda: self.client.hgetall(self.keys.identity)).items()}

    def identity_id(self) -> str | None:
        """The run id alone: one HGET, cheap enough for every learner step."""
        v = self._do(lambda: self.client.hget(self.keys.identity, "id"))
        return None if v is None else as_text(v)

    def create_identity(self, run_id: str) -> None:
        """Name the run in Redis (kept if another learner named it first)."""
        now = repr(self.server_time())
        pipe = self.client.pipeline(transaction=True)
        pipe.hsetnx(self.keys.identity, "id", run_id)
        pipe.hsetnx(self.keys.identity, "created_at", now)
        self._do(pipe.execute)

    def record_reset(self, run_id: str, step: int, trained_before: int) -> None:
        """Name the run again in a Redis that lost its data, recording the loss: when, at which learner step, and
        how many groups had been trained before it (no longer in ``stats``; ``grpo status`` reports them)."""
        now = repr(self.server_time())
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.keys.identity, mapping={"id": run_id, "reset_at": now, "reset_step": step,
                                               "trained_before_reset": trained_before})  # fmt: skip
        pipe.hsetnx(self.keys.identity, "created_at", now)
        pipe.hincrby(self.keys.identity, "resets", 1)
        self._do(pipe.execute)

    def stats(self) -> dict[str, int]:
        return {as_text(k): int(v) for k, v in self._do(lambda: self.client.hgetall(self.keys.stats)).items()}

    def started_signs(self) -> tuple[bool, int]:
        """Whether weights are announced (the learner has loaded its model) and how many groups actors have sent:
        one round trip, for a view of the run's start-up."""
        pipe = self.client.pipeline(transaction=False)
        pipe.exists(self.keys.weights_latest)
        pipe.hget(self.keys.stats, "groups_produced")
        announced, produced = self._do(pipe.execute)
        return bool(announced), int(produced or 0)

    def run_seen(self) -> bool:
        """Whether Redis holds any key of this run: its identity (a learner started), counters or stream (an actor
        sent groups), the prompt cursor or a reserved round (an actor is sampling its first), dead letters, an
        announcement or the done mark. One EXISTS: the keys share one slot."""
        k = self.keys
        keys = (k.identity, k.stats, k.groups, k.prompts_cursor, k.inflight, k.dead, k.weights_latest, k.done,
                k.filtered)  # fmt: skip
        return bool(self._do(lambda: self.client.exists(*keys)))

    def run_names(self, max_scans: int) -> list[str]:
        """The names of the runs with keys in this Redis, sorted, from at most ``max_scans`` SCAN calls of 1000 keys:
        a hint, not an inventory. ``redis.ResponseError`` where this user may not SCAN (an ACL user limited to its
        run's keys)."""
        names: set[str] = set()
        cursor = 0
        for _ in range(max_scans):
            cursor, found = self.client.scan(cursor, match="grpo:{*}:*", count=1000)
            names.update(m.group(1) for key in found if (m := re.match(r"grpo:\{(.*?)\}:", as_text(key))))
            if cursor == 0:
                break
        return sorted(names)

    def delete_run(self) -> None:
        """Remove every key of this run (used before a fresh run under a reused name)."""
        keys: Iterable[bytes] = list(self.client.scan_iter(match=self.keys.prefix + "*", count=500))
        if keys:
            self._do(lambda: self.client.delete(*keys))


@dataclass(frozen=True)
class Balance:
    """The accounting equation of DESIGN §4, read from Redis alone."""

    produced: int
    trained: int
    dropped: dict[str, int]
    dead: int
    in_stream: int  # unread + pending (acked entries are deleted)
    filtered: dict[str, int]
    unread: int = 0  # in the stream, not yet read by a learner
    # (the rest of in_stream is pending: read, and waiting for the checkpoint that covers its step)
    discarded: dict[str, int] = field(default_factory=dict)  # sampled by actors, never sent (outside the equation)

    @property
    def pending(self) -> int:
        return self.in_stream - self.unread

    @property
    def unexplained(self) -> int:
        return self.produced - self.trained - sum(self.dropped.values()) - self.dead - self.in_stream

    def equation(self) -> str:
        dropped = sum(self.dropped.values())
        ok = "balanced" if self.unexplained == 0 else f"UNEXPLAINED {self.unexplained}"
        return (
            f"produced {self.produced} = trained {self.trained} + dropped {dropped} + dead {self.dead}"
            f" + pending {self.pending} + unread {self.unread}  ({ok})"
        )


def read_balance(t: Transport) -> Balance:
    # One transaction, so the counters and the stream length are read at the same instant.
    pipe = t.client.pipeline(transaction=True)
    pipe.hgetall(t.keys.stats)
    pipe.xlen(t.keys.groups)
    t._unread_script(keys=[t.keys.groups], args=[CONSUMER_GROUP], client=pipe)
    raw, xlen, unread = t._do(pipe.execute)
    s = {as_text(k): int(v) for k, v in raw.items()}
    return Balance(
        produced=s.get("groups_produced", 0),
        trained=s.get("groups_trained", 0),
        dropped={k.split(":", 1)[1]: v for k, v in s.items() if k.startswith("groups_dropped:")},
        dead=s.get("groups_dead", 0),
        in_stream=int(xlen),
        filtered={k.split(":", 1)[1]: v for k, v in s.items() if k.startswith("groups_filtered:")},
        unread=int(unread),
        discarded={k.split(":", 1)[1]: v for k, v in s.items() if k.startswith("groups_discarded:")},
    )
