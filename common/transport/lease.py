"""One learner per run (part of common.transport): the learner's lease, and the fence on every write it makes.

A learner takes the run's lease (hash ``learner:lease``, with a TTL of ``run.lease_ttl_s``) before it writes anything
of the run, and renews it from a thread. Each new holder gets a fencing token one above the last (string
``learner:token``, which never expires; a learner seeds it with the highest token its files carry, so tokens keep
growing after Redis lost its data). Every write a learner makes runs as a script that first checks the token (the
fence, :data:`FENCE`): a learner that lost the lease (frozen or cut off past its TTL while another took over) has
each write refused by Redis itself, in the instant it tries it, and stops (:class:`LeaseLost`).

A lease that lapsed while nobody took over (a learner frozen, or Redis frozen or restarted, past the TTL; or Redis
lost its data) is taken again by the same holder with the same token at its next renewal or write: the token counter
still names it (or is gone with Redis's data), so no other learner wrote in between.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, cast

import redis
from redis.commands.core import Script

from common.schemas import LeaseHolder, as_text
from common.transport.connection import Connection, Lua

log = logging.getLogger("common.transport")


class LeaseHeld(RuntimeError):
    """Another learner holds the run (``learner.if_held: exit``, or waited ``learner.held_wait_s`` in vain)."""


class LeaseLost(RuntimeError):
    """A newer learner took the run over: Redis refused this one's write, or its renewal."""


# Prepended to every script a learner writes with. KEYS[1], KEYS[2] and ARGV[1] are the fence's (the lease, the token
# counter, the writer's token: '' for a process that holds no lease, an actor or an operator) and are removed before
# the script's own body reads KEYS and ARGV. A refusal is an error reply, before the body has written anything.
FENCE = """
local fence_lease, fence_counter = table.remove(KEYS, 1), table.remove(KEYS, 1)
local fence_token = table.remove(ARGV, 1)
if fence_token ~= '' then
  local held = redis.call('HGET', fence_lease, 'token')
  if held ~= fence_token then
    if held then return redis.error_reply('GRPO_FENCED the run is held by lease token ' .. held) end
    local last = redis.call('GET', fence_counter)
    if last and last ~= fence_token then
      return redis.error_reply('GRPO_FENCED lease token ' .. last .. ' took the run over')
    end
    return redis.error_reply('GRPO_LAPSED')
  end
end
"""

# Take the lease (KEYS: lease, counter; ARGV: holder, host, pid, TTL ms, the floor of the token). Returns {1, token}
# when taken (or already this holder's: a retried call whose reply was lost), {0, the holder's fields, PTTL} when
# another holds it.
_ACQUIRE = """
local held = redis.call('HGETALL', KEYS[1])
if #held > 0 then
  local mine = false
  for i = 1, #held, 2 do if held[i] == 'holder' and held[i + 1] == ARGV[1] then mine = true end end
  if not mine then return {0, held, redis.call('PTTL', KEYS[1])} end
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  return {1, redis.call('HGET', KEYS[1], 'token')}
end
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
if tonumber(ARGV[5]) > last then last = tonumber(ARGV[5]) end
local token = string.format('%d', last + 1)
local now = redis.call('TIME')
redis.call('SET', KEYS[2], token)
redis.call('HSET', KEYS[1], 'token', token, 'holder', ARGV[1], 'host', ARGV[2], 'pid', ARGV[3],
           'since', now[1] .. '.' .. string.format('%06d', tonumber(now[2])))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {1, token}
"""

# Renew (ARGV: token, TTL ms, the floor, then the holder's fields to write again). 1: renewed; 2: it had lapsed and
# nobody took over (the counter still says this token, or Redis lost it, and no holder's marker has a higher one):
# taken again; an error reply when another holds it or did.
_RENEW = """
local held = redis.call('HGET', KEYS[1], 'token')
if held == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if held then return redis.error_reply('GRPO_FENCED the run is held by lease token ' .. held) end
local last = redis.call('GET', KEYS[2])
if last and last ~= ARGV[1] then
  return redis.error_reply('GRPO_FENCED lease token ' .. last .. ' took the run over')
end
if tonumber(ARGV[3]) > tonumber(ARGV[1]) then
  return redis.error_reply('GRPO_FENCED lease token ' .. ARGV[3] .. ' took the run over (its marker says so)')
end
redis.call('SET', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 2
"""

_RELEASE = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# A learner's plain writes, each one command on one key of the run (or none, for PUBLISH): ARGV holds, per command,
# its argument count, its name, the index of its key in KEYS (0: none), then its arguments.
_WRITE = """
local i = 1
while i <= #ARGV do
  local n, k = tonumber(ARGV[i]), tonumber(ARGV[i + 2])
  if k > 0 then
    redis.call(ARGV[i + 1], KEYS[k], unpack(ARGV, i + 3, i + 2 + n))
  else
    redis.call(ARGV[i + 1], unpack(ARGV, i + 3, i + 2 + n))
  end
  i = i + 3 + n
end
return 1
"""

# One write: (command, key or None, arguments...).
Command = tuple[Any, ...]


class Fenced(Lua):
    """A Lua script a learner writes with: the fence runs first (see :data:`FENCE`), with this connection's token."""

    def __init__(self, source: str):
        super().__init__(FENCE + source)

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        script = super().__get__(obj, owner)
        return functools.partial(obj.fenced_call, script)


class Leasing(Connection):
    """The lease, and the fence every learner write goes through (:meth:`fenced_call`, :meth:`write`)."""

    _lease_acquire_script = Lua(_ACQUIRE)
    _lease_renew_script = Lua(_RENEW)
    _lease_release_script = Lua(_RELEASE)
    _fenced_write_script = Fenced(_WRITE)
    fence = ""  # this process's lease token ('' until it holds the lease: then every write is fenced)
    holder: LeaseHolder | None = None
    lease_ttl_ms = 0
    # The highest token a holder of the run ever had, read from its files (learner.fencing): after Redis lost the
    # counter, a lapsed holder takes its lease again only if no later holder's marker says one took over.
    lease_floor: Callable[[], int] = staticmethod(lambda: 0)

    def acquire_lease(self, holder: LeaseHolder, ttl_s: float, floor: int) -> LeaseHolder | None:
        """Take the run's lease with a token above ``floor`` and every earlier holder's: None once taken (this
        connection's writes are fenced from then on), else who holds it (with its TTL)."""
        ttl_ms = max(1, int(ttl_s * 1000))
        keys = [self.keys.lease, self.keys.lease_token]
        args: list[Any] = [holder.holder, holder.host, holder.pid, ttl_ms, floor]
        reply: Any = self._do(lambda: self._lease_acquire_script(keys=keys, args=args))
        if int(reply[0]) == 0:
            fields = reply[1]
            found = dict(zip(fields[::2], fields[1::2], strict=True))
            return LeaseHolder.from_hash(found, ttl_s=max(0, int(reply[2])) / 1000)
        token = int(as_text(reply[1]))
        now = self.server_time()
        self.holder = LeaseHolder(token, holder.holder, holder.host, holder.pid, now)
        self.lease_ttl_ms = ttl_ms
        self.fence = str(token)
        return None

    def renew_lease(self) -> bool:
        """Extend the lease; True when it had lapsed and was taken again (nobody took over); :class:`LeaseLost`
        when another learner holds the run."""
        assert self.holder is not None
        fields = (x for kv in self.holder.to_hash().items() for x in kv)
        args: list[Any] = [self.fence, self.lease_ttl_ms, self.lease_floor(), *fields]
        try:
            got = self._do(lambda: self._lease_renew_script(keys=[self.keys.lease, self.keys.lease_token], args=args))
        except redis.ResponseError as e:
            if not _fenced(e):  # any other reply is no word on who holds the run
                raise
            raise _lost(e) from None
        if int(cast(Any, got)) == 2:
            log.warning("the learner's lease had lapsed (this process or Redis was frozen or cut off past "
                        "run.lease_ttl_s) and no other learner took the run: holding it again, token %s",
                        self.fence)  # fmt: skip
            return True
        return False

    def release_lease(self) -> None:
        """Give the run up (a learner that stops cleanly), if it still holds it; its writes are no longer fenced."""
        if self.fence:
            self._do(lambda: self._lease_release_script(keys=[self.keys.lease], args=[self.fence]))
        self.fence = ""

    def lease_token(self) -> int:
        """This process's lease token (0: it holds none), which the files it writes carry (learner.fencing)."""
        return int(self.fence or 0)

    def lease_holder(self) -> LeaseHolder | None:
        """Who holds the run now, with the lease's TTL (None: nobody); SchemaError (one line) on a malformed hash."""

        def build(pipe: Any) -> None:
            pipe.hgetall(self.keys.lease)
            pipe.pttl(self.keys.lease)

        h, pttl = self._batch(build, transaction=True)
        return LeaseHolder.from_hash(h, ttl_s=max(0, int(pttl)) / 1000) if h else None

    def fenced_call(self, script: Script, keys: list[str], args: list[Any], client: Any = None) -> Any:
        """Run ``script`` behind the fence: refused (:class:`LeaseLost`) when this process's token is no longer the
        run's; a lease that lapsed with nobody taking over is taken again and the call made once more."""
        keys = [self.keys.lease, self.keys.lease_token, *keys]
        for attempt in (1, 2):
            try:
                return self._do(lambda: script(keys=keys, args=[self.fence, *args], client=client))
            except redis.ResponseError as e:
                text = str(e)
                if text.startswith("GRPO_LAPSED") and attempt == 1 and self.holder is not None:
                    self.renew_lease()
                    continue
                if _fenced(e):
                    raise _lost(e) from None
                raise
        raise AssertionError("unreachable")

    def write(self, *commands: Command) -> None:
        """Run ``commands`` (each ``(name, key or None, args...)``) as one script behind the fence: atomic, and
        refused whole when this learner no longer holds the run."""
        keys: list[str] = []
        args: list[Any] = []
        for name, key, *rest in commands:
            if key is not None and key not in keys:
                keys.append(key)
            args += [len(rest), name, 0 if key is None else keys.index(key) + 1, *rest]
        self._fenced_write_script(keys, args)


def _fenced(e: redis.ResponseError) -> bool:
    """Whether a reply is the fence's (or the renewal's) refusal: another learner holds the run, or the lease lapsed.
    Nothing else is, a Redis refusing commands for now least of all (those are waited out, Connection._do)."""
    return str(e).startswith(("GRPO_FENCED", "GRPO_LAPSED"))


def _lost(e: redis.ResponseError) -> LeaseLost:
    reason = str(e).removeprefix("GRPO_FENCED ").removeprefix("GRPO_LAPSED")
    return LeaseLost(f"this learner no longer holds the run ({reason or 'its lease lapsed'}); another learner does")


def lease_line(h: LeaseHolder | None) -> str:
    """The holder in words: for ``grpo status`` and for the line of a learner that waits for it."""
    if h is None:
        return "no learner holds the run (none is training it, or the last one died and its lease ran out)"
    since = datetime.fromtimestamp(h.since, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    ttl = "" if h.ttl_s is None else f", its lease ends in {h.ttl_s:.0f}s unless renewed"
    return f"held by {h.who()} since {since}{ttl}"
