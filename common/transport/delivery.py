"""The learner's side of the groups stream (part of common.transport): delivering entries within a byte budget
(an oversized one is dead-lettered inside Redis and never leaves it), taking over a dead learner's pending entries,
and settling each group (trained, dropped) in the script that counts it, so the accounting equation holds."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

from common.schemas import MAX_MARKED_POSITION, DropReason, as_text, counter
from common.transport.connection import CONSUMER_GROUP
from common.transport.lease import Fenced, Leasing

_SCRIPT_CHUNK = 1000  # ids per script call (Lua's unpack has a stack limit)
DEAD_PREFIX_BYTES = 4096  # what the dead stream keeps of an oversized message: enough to see what it was


# Settling a group (trained, dropped, dead) is one Lua script, atomic like MULTI/EXEC, and idempotent: a command
# retried after its reply was lost finds the entry already deleted and counts nothing twice, so the equation holds.
_SETTLE = """
redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 3))
local deleted = redis.call('XDEL', KEYS[1], unpack(ARGV, 3))
if deleted > 0 then redis.call('HINCRBY', KEYS[2], ARGV[2], deleted) end
return deleted
"""


# Trained groups are also remembered by group id (scored by learner step, the oldest forgotten), so a group delivered
# twice (an actor's write retried after a lost reply) is recognised and trained once. Each group's prompt position
# (ARGV[5 + n + i], -1 for a group without one) is marked in the bitmap prompts:trained as its entry is deleted: a
# position marked already (trained before in this pass) is counted as prompts_retrained, never silent.
_SETTLE_TRAINED = """
local n = tonumber(ARGV[4])
local ids = {unpack(ARGV, 5, 4 + n)}
redis.call('XACK', KEYS[1], ARGV[1], unpack(ids))
local deleted, marked, again = 0, 0, 0
for i = 1, n do
  if redis.call('XDEL', KEYS[1], ids[i]) == 1 then
    deleted = deleted + 1
    local position = tonumber(ARGV[4 + 2 * n + i])
    if position ~= nil and position >= 0 then
      if redis.call('SETBIT', KEYS[4], position, 1) == 1 then again = again + 1 else marked = marked + 1 end
    end
  end
end
if deleted > 0 then redis.call('HINCRBY', KEYS[2], 'groups_trained', deleted) end
if marked > 0 then redis.call('HINCRBY', KEYS[2], 'prompts_trained', marked) end
if again > 0 then redis.call('HINCRBY', KEYS[2], 'prompts_retrained', again) end
for i = 5 + n, 4 + 2 * n do redis.call('ZADD', KEYS[3], ARGV[2], ARGV[i]) end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[3])
return deleted
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

# The stream and its consumer group, from the very first entry; one that exists already is left as it is.
_ENSURE_GROUP = """
local r = redis.pcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0', 'MKSTREAM')
if type(r) == 'table' and r.err and not string.find(r.err, 'BUSYGROUP') then return r end
return 1
"""


@dataclass(frozen=True)
class ReadLimits:
    """What one delivery to the learner may load: an entry over ``max_bytes`` is dead-lettered inside Redis (its
    first ``DEAD_PREFIX_BYTES`` kept) and never returned; a delivery stops once its entries hold ``budget_bytes``
    (at least one entry is returned). ``dead_keep``: about how many entries the dead stream keeps."""

    max_bytes: int
    budget_bytes: int
    dead_keep: int = 100_000


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


class Delivering(Leasing):
    """What the learner does with the groups stream: read, take over, settle; each behind the learner's fence
    (common.transport.lease), as reading assigns entries to a consumer and settling counts them."""

    _settle_script = Fenced(_SETTLE)
    _settle_trained_script = Fenced(_SETTLE_TRAINED)
    _deliver_script = Fenced(_DELIVER)
    _claim_ids_script = Fenced(_CLAIM_IDS)
    _ensure_group_script = Fenced(_ENSURE_GROUP)

    def ensure_consumer_group(self) -> None:
        """Create the stream and the ``learners`` group, reading from the very first entry (id 0): groups that
        actors XADD before the learner first starts are trained, not skipped."""
        self._ensure_group_script(keys=[self.keys.groups], args=[CONSUMER_GROUP])

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
        taken, dead, entries = cast(Any, self._deliver_script(keys=keys, args=args))
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
            reply: Any = self._claim_ids_script(keys=[self.keys.groups], args=args)
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
            chunk = ids[i : i + _SCRIPT_CHUNK]
            self._settle_script(keys=[self.keys.groups, self.keys.stats], args=[CONSUMER_GROUP, counter, *chunk])

    def ack_trained(
        self,
        ids: list[str],
        group_ids: list[str],
        step: int = 0,
        window: int = 1000,
        positions: list[int] | None = None,
    ) -> None:
        """After the optimizer step that used them (and the checkpoint that covers it): XACK + XDEL +
        groups_trained, remember the group ids for ``window`` steps, and mark their prompt ``positions`` trained
        (-1 or None: a group without one), atomically."""
        marks = [p if p is not None and 0 <= p <= MAX_MARKED_POSITION else -1 for p in positions or [-1] * len(ids)]
        if len(marks) != len(ids) or len(group_ids) != len(ids):
            raise ValueError(f"{len(ids)} entries, {len(group_ids)} group ids, {len(marks)} positions")
        for i in range(0, len(ids), _SCRIPT_CHUNK):
            part, gids, at = ids[i : i + _SCRIPT_CHUNK], group_ids[i : i + _SCRIPT_CHUNK], marks[i : i + _SCRIPT_CHUNK]
            self._settle_trained_script(
                keys=[self.keys.groups, self.keys.stats, self.keys.trained_ids, self.keys.prompts_trained],
                args=[CONSUMER_GROUP, step, step - window, len(part), *part, *gids, *at],
            )

    def trained_before(self, group_ids: list[str]) -> list[bool]:
        """Whether each group id was trained on already (within the remembered window)."""
        if not group_ids:
            return []
        scores = self._do(lambda: self.client.zmscore(self.keys.trained_ids, group_ids))
        return [s is not None for s in scores]

    def drop(self, ids: list[str], reason: DropReason) -> None:
        """Groups the learner refuses (e.g. too stale): XACK + XDEL + groups_dropped:<reason>, atomically."""
        self._settle(ids, counter("dropped", reason))
