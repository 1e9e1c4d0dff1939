"""The actors' side of the groups stream (part of common.transport): writing a round with its counters in one
script, and the admission rule that reserves room for a round before it is sampled (``inflight``), so that
generation is not spent on groups the learner would drop as stale."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from common.schemas import FilteredStats, as_text
from common.transport.connection import CONSUMER_GROUP, Connection, Lua

# Unread entries: XLEN minus the consumer group's pending count (no group yet: all of them).
_UNREAD_LUA = """
local function unread(stream, group)
  local n = redis.call('XLEN', stream)
  local ok, info = pcall(redis.call, 'XPENDING', stream, group)
  if ok and info then n = n - info[1] end
  return n
end
"""


UNREAD = _UNREAD_LUA + "return unread(KEYS[1], ARGV[1])"


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
# renewed by the actor's heartbeat: a killed actor's expires and is removed here. A reservation's value is the wire
# module's Reservation form, "<groups> <lease end ms>", which this script and _RENEW write and read.
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


class MessageTooLarge(ValueError):
    """A group message over ``redis.max_message_bytes``: refused by the script that writes, nothing written."""


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


class Producing(Connection):
    """What actors do with the groups stream, the prompt cursor and their reservations."""

    _produce_script = Lua(_PRODUCE)
    _reserve_script = Lua(_RESERVE)
    _renew_script = Lua(_RENEW)
    _unread_script = Lua(UNREAD)

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

    def stream_length(self) -> int:
        return int(self._do(lambda: self.client.xlen(self.keys.groups)))

    def unread(self) -> int:
        """Groups in the stream that no learner has read yet (its length minus the pending entries)."""
        return int(self._do(lambda: self._unread_script(keys=[self.keys.groups], args=[CONSUMER_GROUP])))

    def next_prompts(self, k: int) -> range:
        """Claim ``k`` consecutive prompt positions from the shared cursor (positions, not dataset indices)."""
        end = int(self._do(lambda: self.client.incrby(self.keys.prompts_cursor, k)))
        return range(end - k, end)
