"""The prompt positions' side of the run's keys (part of common.transport): actors draw positions for a round under a
claim, and every position drawn is accounted for (common.schemas.prompts: the forms and the equation).

- A round's positions are drawn in one script (:data:`_DRAW`): first positions given back to be drawn again
  (``prompts:redraw``), then new ones from the shared cursor (``prompts:cursor``), recorded as the round holder's
  claim (``prompts:claims``) with a lease on Redis's clock, renewed by the actor's heartbeat with its reservation.
- The script that writes a round (common.transport.admission) settles its claim: the positions' fates are counted
  (sent, filtered, discarded, skipped) and the claim ends, in the same step as the groups enter the stream. A round
  whose claim is gone (its actor was frozen or cut off past the lease, and its positions went to others) is refused
  whole: :class:`ClaimLost`. A claim names the round holding it (a token of the process's, ``Connection.rounds``):
  a round's further draws, its write and its release act on the claim only while it is that round's, since another
  process may hold one under the same holder name.
- A claim whose lease ran out is given back by the next draw of any actor (``prompts_requeued:lost``), one that an
  actor lets go of by :meth:`Drawing.release_round` (``prompts_requeued:released``), and a claim left by an earlier
  process under the same holder name by that holder's next round: those positions are drawn again before any new
  one, so a dead actor's prompts are neither skipped nor silently repeated.
- Each process takes its actor id (:meth:`Drawing.take_name`: a generation one above the last, in ``actor_ids``),
  once no process beats under it (actor.identity); one whose id a newer process has taken since (it was frozen past
  its heartbeat) is refused its next draw (:class:`Superseded`) and stops, since each new round of two live
  processes under one name would give back the other's live claim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import redis

from common.schemas import PromptClaim, PromptCounters, RunCounters, claims_of
from common.transport.connection import Connection, Lua, TransportError, call_token
from common.transport.lease import LeaseLost

# A claim value's parts (PromptClaim's form "<lease end ms> r<round> <positions>"): the lease's end, the token of the
# round that holds it ('' in a claim of an earlier build, "<lease end ms> <positions>"), the positions; nil for a
# value of neither form.
CLAIM_LUA = """
local function claim_parts(value)
  local lease, round, rest = string.match(value, '^(%d+) r(%x+) ?(.*)$')
  if lease ~= nil then return lease, round, rest end
  lease, rest = string.match(value, '^(%d+) ?(.*)$')
  return lease, '', rest
end
"""

# Give back the positions of a claim value to prompts:redraw, counted as prompts_requeued:<why>; a value that is not
# a claim's form holds no position anyone can know.
_REQUEUE_LUA = (
    CLAIM_LUA
    + """
local function requeue(value, why, redraw, stats)
  local _, _, rest = claim_parts(value)
  if rest == nil then return 0 end
  local n = 0
  for part in string.gmatch(rest, '[^,]+') do
    local a, b = string.match(part, '^(%d+)-(%d+)$')
    if a == nil then a = string.match(part, '^(%d+)$'); b = a end
    if a ~= nil then
      for p = tonumber(a), tonumber(b) do redis.call('RPUSH', redraw, p); n = n + 1 end
    end
  end
  if n > 0 then redis.call('HINCRBY', stats, 'prompts_requeued:' .. why, n) end
  return n
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""
)

# Draw ARGV[2] positions for holder ARGV[1] under a lease of ARGV[3] ms; ARGV[4] '1' starts the holder's round ARGV[6]
# (a claim it still has is an earlier round's, given back as lost), '0' draws more for round ARGV[6], which its claim
# must still be; ARGV[5] is the call's token; ARGV[7] and ARGV[8] the actor id the process took and its generation
# ('' and '0': none taken). KEYS: claims, redraw, cursor, stats, last (holder -> 'draw <token> <positions>'), actor_ids.
_DRAW = (
    _REQUEUE_LUA
    + """
-- A process whose actor id a newer process has taken since (started while this one was frozen, or configured alike)
-- draws nothing more: each new round of either would give back the other's live claim, and neither would send.
if ARGV[7] ~= '' and (tonumber(redis.call('HGET', KEYS[6], ARGV[7]) or '0') or 0) > tonumber(ARGV[8]) then
  return redis.error_reply('superseded: a newer process took actor id ' .. ARGV[7])
end
-- The same call sent again after its reply was lost (the connection dropped once Redis had run it): it answers what
-- it drew the first time. Drawing anew would leave those positions in the claim, unknown to the actor.
local last = redis.call('HGET', KEYS[5], ARGV[1])
if last then
  local token, drawn = string.match(last, '^draw (%S+) ?(.*)$')
  if token == ARGV[5] then
    local again = {}
    for p in string.gmatch(drawn, '%d+') do again[#again + 1] = tonumber(p) end
    return again
  end
end
local now = now_ms()
local held = redis.call('HGETALL', KEYS[1])
for i = 1, #held, 2 do
  local lease_end = string.match(held[i + 1], '^(%d+)')
  local expired = lease_end == nil or tonumber(lease_end) <= now
  if (held[i] ~= ARGV[1] and expired) or (held[i] == ARGV[1] and ARGV[4] == '1') then
    requeue(held[i + 1], 'lost', KEYS[2], KEYS[4])
    redis.call('HDEL', KEYS[1], held[i])
    if held[i] ~= ARGV[1] then redis.call('HDEL', KEYS[5], held[i]) end
  end
end
-- More for a round whose claim is gone (given back while its actor was gone past its lease), or is another round's
-- (a process started since under the same holder name): its first positions are being drawn again by others, and
-- the round would repeat them. Refused, nothing drawn.
local mine = redis.call('HGET', KEYS[1], ARGV[1])
if ARGV[4] ~= '1' and (not mine or select(2, claim_parts(mine)) ~= ARGV[6]) then
  return redis.error_reply('claim_lost: the claim of ' .. ARGV[1] .. ' on its prompt positions is gone')
end
local k = tonumber(ARGV[2])
local taken = {}
local again = redis.call('LPOP', KEYS[2], k)
if again then
  for _, p in ipairs(again) do taken[#taken + 1] = tonumber(p) end
  redis.call('HINCRBY', KEYS[4], 'prompts_redrawn', #taken)
end
local fresh = k - #taken
if fresh > 0 then
  local finish = redis.call('INCRBY', KEYS[3], fresh)
  for p = finish - fresh, finish - 1 do taken[#taken + 1] = p end
  redis.call('HINCRBY', KEYS[4], 'prompts_drawn', fresh)
end
local parts = {}
if mine and ARGV[4] ~= '1' then
  local _, _, rest = claim_parts(mine)
  if rest and rest ~= '' then parts[1] = rest end
end
local i = 1
while i <= #taken do
  local j = i
  while j < #taken and taken[j + 1] == taken[j] + 1 do j = j + 1 end
  parts[#parts + 1] = (i == j) and tostring(taken[i]) or (taken[i] .. '-' .. taken[j])
  i = j + 1
end
redis.call('HSET', KEYS[1], ARGV[1], (now + tonumber(ARGV[3])) .. ' r' .. ARGV[6] .. ' ' .. table.concat(parts, ','))
redis.call('HSET', KEYS[5], ARGV[1], 'draw ' .. ARGV[5] .. ' ' .. table.concat(taken, ','))
return taken
"""
)

# Let holder ARGV[1]'s round ARGV[2] go unsampled: its reservation ends (unless ARGV[3] is '0': a process whose id a
# newer one took leaves the reservation, which is the newer one's), its positions are given back (released). A claim
# of another round under the holder's name (a process started since with the same name) is not this one's to give.
# KEYS: inflight, claims, redraw, stats.
_RELEASE = (
    _REQUEUE_LUA
    + """
if ARGV[3] ~= '0' then redis.call('HDEL', KEYS[1], ARGV[1]) end
local mine = redis.call('HGET', KEYS[2], ARGV[1])
if mine and select(2, claim_parts(mine)) == ARGV[2] then
  requeue(mine, 'released', KEYS[3], KEYS[4])
  redis.call('HDEL', KEYS[2], ARGV[1])
end
return 1
"""
)


class Superseded(LeaseLost):
    """A newer process took this actor's id (``actor.id``) since this one started: it draws nothing more and stops
    (exit code 5, as a fenced-out learner), so that the two never cancel each other's rounds."""


class ClaimLost(RuntimeError):
    """The round's claim on its positions is gone (its lease ran out and another actor's draw gave them back to be
    drawn again): the script that writes rounds, or draws more for one, refused it whole, writing nothing."""


def claim_lost(e: redis.ResponseError) -> ClaimLost | None:
    """The :class:`ClaimLost` a script's error reply says, or None for another error."""
    return ClaimLost(str(e).split("claim_lost: ", 1)[-1]) if "claim_lost: " in str(e) else None


def superseded(e: redis.ResponseError) -> Superseded | None:
    """The :class:`Superseded` a draw's error reply says, or None for another error."""
    return Superseded(str(e).split("superseded: ", 1)[-1]) if "superseded: " in str(e) else None


class Drawing(Connection):
    """What actors do with prompt positions: draw them under a claim, let a round go."""

    _draw_script = Lua(_DRAW)
    _release_script = Lua(_RELEASE)

    def take_name(self, actor_id: str) -> int:
        """This process draws as ``actor_id`` from now on, under a generation one above the last process's that took
        it (``actor_ids``): an earlier process still running under the id is refused its next draw
        (:class:`Superseded`). Returns the generation; above 1, the id was used before (a restart, or a twin)."""
        try:
            generation = int(self._do(lambda: self.client.hincrby(self.keys.actor_ids, actor_id, 1)))
        except redis.ResponseError as e:  # (a value or key of another kind, written by hand)
            raise TransportError(f"{self.keys.actor_ids}.{actor_id} cannot be read ({e}): delete it") from None
        self.rounds.name, self.rounds.generation = actor_id, generation
        return generation

    def next_prompts(self, k: int, holder: str, lease_s: float, *, new_round: bool = True) -> list[int]:
        """Claim ``k`` prompt positions (positions, not dataset indices) for ``holder``'s round: positions given back
        by others first, then the shared cursor's next. ``new_round``: the first draw of a round (a claim the holder
        still has is an earlier process's, given back); difficulty sampling draws more for the same round with
        False, and :class:`ClaimLost` (nothing drawn) where the round's claim is gone. The claim lasts ``lease_s``
        (renewed with the reservation) and ends when the round is written. The call carries a token of its own, so
        that sent again after a lost reply it answers what it drew (``prompts:last``)."""
        if k <= 0:
            return []
        keys = [self.keys.prompts_claims, self.keys.prompts_redraw, self.keys.prompts_cursor, self.keys.stats,
                self.keys.prompts_last, self.keys.actor_ids]  # fmt: skip
        round_token = self.rounds.start(holder) if new_round else self.rounds.of(holder)
        args: list[str | int] = [holder, k, max(1, int(lease_s * 1000)), "1" if new_round else "0", call_token(),
                                 round_token, self.rounds.name, self.rounds.generation]  # fmt: skip
        try:
            drawn = self._do(lambda: self._draw_script(keys=keys, args=args))
        except redis.ResponseError as e:
            raise claim_lost(e) or superseded(e) or e from None
        return [int(p) for p in cast(list, drawn)]

    def release_round(self, holder: str, *, reservation: bool = True) -> None:
        """Give up ``holder``'s reservation and the positions it claimed (a round it will not sample or send): they
        are drawn again by the next round of any actor. ``reservation`` False: the claim alone (a process whose id a
        newer one took: the reservation under the name is the newer one's)."""
        keys = [self.keys.inflight, self.keys.prompts_claims, self.keys.prompts_redraw, self.keys.stats]
        args = [holder, self.rounds.of(holder), "1" if reservation else "0"]
        self._do(lambda: self._release_script(keys=keys, args=args))


@dataclass(frozen=True)
class PromptBalance:
    """The prompts' equation (common.schemas.prompts), read in one transaction: the counters, the claims of the
    rounds being sampled (``expired``: those whose lease ran out, their actor gone, given back at the next draw)
    and the positions waiting to be drawn again."""

    counters: PromptCounters
    claims: dict[str, PromptClaim] = field(default_factory=dict)
    to_redraw: int = 0
    now_ms: int = 0

    @property
    def claimed(self) -> int:
        return sum(len(c.positions) for c in self.claims.values())

    @property
    def expired(self) -> int:
        return sum(len(c.positions) for c in self.claims.values() if c.lease_end_ms <= self.now_ms)

    @property
    def unexplained(self) -> int:
        return self.counters.drawn - self.counters.settled() - self.claimed - self.to_redraw

    def equation(self) -> str:
        c = self.counters
        ok = "balanced" if self.unexplained == 0 else f"UNEXPLAINED {self.unexplained}"
        gone = f", {self.expired} of them held by actors gone" if self.expired else ""
        return (
            f"prompts drawn {c.drawn} = sent {c.sent} + filtered {sum(c.filtered.values())} + discarded "
            f"{sum(c.discarded.values())} + skipped {sum(c.skipped.values())} + in flight {self.claimed}{gone} + to "
            f"redraw {self.to_redraw}  ({ok})"
        )


class PromptsReading(Connection):
    """What the operator reads of the prompts' accounting (``grpo status``)."""

    def prompt_balance(self) -> PromptBalance:
        def build(pipe: Any) -> None:
            pipe.hgetall(self.keys.stats)
            pipe.hgetall(self.keys.prompts_claims)
            pipe.llen(self.keys.prompts_redraw)
            pipe.time()

        stats, claims, to_redraw, (seconds, micros) = self._batch(build, transaction=True)
        now_ms = int(seconds) * 1000 + micros // 1000
        return PromptBalance(RunCounters.from_hash(stats).prompts, claims_of(claims), int(to_redraw), now_ms)
