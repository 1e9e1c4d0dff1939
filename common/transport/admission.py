"""The actors' side of the groups stream (part of common.transport): writing a round with its counters in one
script, and the admission rule that reserves room for a round before it is sampled (``inflight``), so that
generation is not spent on groups the learner would drop as stale."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from common.schemas import FilteredStats, as_text
from common.transport.connection import CONSUMER_GROUP, Connection, Lua, call_token
from common.transport.prompts import CLAIM_LUA, claim_lost

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


# ARGV: consumer group, bound, holder, #counters, #sums, largest message, claim ('settle <token> <round>': the
# holder's claim on its prompt positions must be there, the round's, and ends; '': claims untouched), then the
# counters, the sums, the payloads. KEYS: groups, stats, inflight, filtered, prompts:claims, prompts:last.
_PRODUCE = (
    _UNREAD_LUA
    + CLAIM_LUA
    + """
local ncount = tonumber(ARGV[4])
local nsums = tonumber(ARGV[5])
local first = 8 + 2 * ncount + 2 * nsums
local npay = #ARGV - first + 1
local bound = tonumber(ARGV[2])
local most = tonumber(ARGV[6])
local token, round = string.match(ARGV[7], '^settle (%S+) ?(%S*)$')
local settle = token ~= nil and ARGV[3] ~= ''
for i = first, #ARGV do
  if most >= 0 and #ARGV[i] > most then
    return redis.error_reply('oversized: a message of ' .. #ARGV[i] .. ' bytes, over the limit of ' .. most)
  end
end
-- A claim another actor's draw gave back (this actor was gone past its lease) is not this round's any more: its
-- positions are being drawn again, and the round would repeat them; nor is one another round holds under the same
-- name (a process started since with this actor's id).
-- The same write sent again after its reply was lost (Redis had run it: the claim it settled is gone) is done.
if settle then
  local mine = redis.call('HGET', KEYS[5], ARGV[3])
  if not mine or select(2, claim_parts(mine)) ~= round then
    if redis.call('HGET', KEYS[6], ARGV[3]) == 'settled ' .. token then return {} end
    return redis.error_reply('claim_lost: the claim of ' .. ARGV[3] .. ' on its prompt positions is gone')
  end
end
if npay > 0 and bound >= 0 then
  local waiting = unread(KEYS[1], ARGV[1])
  if waiting > 0 and waiting + npay > bound then return false end  -- round_fits(), the rule actors wait on
end
local ids = {}
for i = first, #ARGV do ids[#ids + 1] = redis.call('XADD', KEYS[1], '*', 'data', ARGV[i]) end
if npay > 0 then redis.call('HINCRBY', KEYS[2], 'groups_produced', npay) end
for i = 0, ncount - 1 do redis.call('HINCRBY', KEYS[2], ARGV[8 + 2 * i], ARGV[9 + 2 * i]) end
for i = 0, nsums - 1 do
  redis.call('HINCRBYFLOAT', KEYS[4], ARGV[8 + 2 * ncount + 2 * i], ARGV[9 + 2 * ncount + 2 * i])
end
if ARGV[3] ~= '' then redis.call('HDEL', KEYS[3], ARGV[3]) end  -- the round is in: its reservation ends
if settle then  -- and its positions' fates are in the counters above
  redis.call('HDEL', KEYS[5], ARGV[3])
  redis.call('HSET', KEYS[6], ARGV[3], 'settled ' .. token)
end
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


# Renew holder ARGV[1]'s reservation (KEYS[1], inflight) and its claim on prompt positions (KEYS[2], prompts:claims;
# common.transport.prompts: its round and positions kept), whichever it has, by ARGV[2] ms from now; the claim only
# while it is round ARGV[3]'s, this process's: another process's under the same name (one started while this one was
# frozen) is not this heartbeat's to keep alive.
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease_end = now + tonumber(ARGV[2])
local v = redis.call('HGET', KEYS[1], ARGV[1])
if v then
  local n = string.match(v, '^(%d+) ') or '0'
  redis.call('HSET', KEYS[1], ARGV[1], n .. ' ' .. lease_end)
end
local c = redis.call('HGET', KEYS[2], ARGV[1])
if c then
  local round, rest = string.match(c, '^%d+ r(%x+) ?(.*)$')
  if round == ARGV[3] then redis.call('HSET', KEYS[2], ARGV[1], lease_end .. ' r' .. round .. ' ' .. rest) end
end
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
    """What actors do with the groups stream and their reservations (the prompt positions: common.transport.prompts)."""

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
        claim: bool = False,
    ) -> list[str] | None:
        """XADD groups and count them as produced, atomically: all of them or none.

        ``counters`` are other ``stats`` increments of the same round, such as ``groups_filtered:zero_std`` for
        groups that were sampled and not sent (they never enter the stream). With ``bound``, nothing is written and
        None is returned when the stream's unread groups plus these would exceed it (a round always fits an empty
        stream): the check and the writes are one script, so many actors together never overshoot the bound.
        Written, the round ends ``holder``'s reservation (:meth:`reserve_round`). ``filtered`` summarises the
        round's groups that were sampled and filtered out: added to the ``filtered`` hash in the same script, so the
        learner's reward figures count them whatever becomes of the groups sent. A payload over ``max_bytes`` makes
        the script refuse the whole call (:class:`MessageTooLarge`), writing nothing. With ``claim``, the round
        also settles ``holder``'s claim on its prompt positions (common.transport.prompts: ``counters`` carry their
        fates, ``prompts_*``); when that claim is gone, the script refuses the call, writing nothing
        (:class:`ClaimLost`), unless this very call settled it already (sent again after a lost reply: it answers
        ``[]``, having written once)."""
        counters = {k: n for k, n in (counters or {}).items() if n}
        sums = filtered.fields() if filtered is not None and filtered.groups else {}
        if not payloads and not counters and not sums and not (claim and holder):
            return []
        args: list[Any] = [CONSUMER_GROUP, -1 if bound is None else bound, holder, len(counters), len(sums)]
        settle = f"settle {call_token()} {self.rounds.of(holder)}" if claim and holder else ""
        args += [-1 if max_bytes is None else max_bytes, settle]
        for name, n in [*counters.items(), *sums.items()]:
            args += [name, repr(n) if isinstance(n, float) else n]
        keys = [self.keys.groups, self.keys.stats, self.keys.inflight, self.keys.filtered, self.keys.prompts_claims,
                self.keys.prompts_last]  # fmt: skip
        try:
            reply = self._do(lambda: self._produce_script(keys=keys, args=[*args, *payloads]))
        except redis.ResponseError as e:
            if "oversized" in str(e):
                raise MessageTooLarge(str(e).split("oversized: ", 1)[-1]) from None
            raise claim_lost(e) or e from None
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
        """Extend ``holder``'s reservation and its claim on prompt positions, those it has, by ``lease_s`` from now
        (with each heartbeat); the claim only while it is this process's round's."""
        lease_ms = max(1, int(lease_s * 1000))
        keys = [self.keys.inflight, self.keys.prompts_claims]
        self._do(lambda: self._renew_script(keys=keys, args=[holder, lease_ms, self.rounds.of(holder)]))

    def stream_length(self) -> int:
        return int(self._do(lambda: self.client.xlen(self.keys.groups)))

    def unread(self) -> int:
        """Groups in the stream that no learner has read yet (its length minus the pending entries)."""
        return int(self._do(lambda: self._unread_script(keys=[self.keys.groups], args=[CONSUMER_GROUP])))
