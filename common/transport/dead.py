"""Dead letters (part of common.transport): messages that failed to decode or validate, moved from the groups
stream to the ``dead`` stream with their reason in one script that counts them (``groups_dead``), read back by the
operator, and replayed into the groups stream (counted as produced once more, so the equation still holds)."""

from __future__ import annotations

import time
from typing import Any

import redis

from common.schemas import DeadLetter, as_text
from common.transport.connection import CONSUMER_GROUP, Connection, Lua
from common.transport.delivery import DEAD_PREFIX_BYTES, StreamEntry
from common.transport.lease import Fenced, Leasing

_DEAD_LETTER = """
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
if redis.call('XDEL', KEYS[1], ARGV[2]) == 0 then return 0 end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'reason', ARGV[3], 'payload', ARGV[4], 'source_id', ARGV[2],
           'at', ARGV[5], 'size', #ARGV[4])
redis.call('HINCRBY', KEYS[2], 'groups_dead', 1)
return 1
"""


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


class DeadLettering(Leasing):
    """The learner's side: moving a message it cannot read to the ``dead`` stream, behind its fence."""

    _dead_script = Fenced(_DEAD_LETTER)

    def dead_letter(self, entry: StreamEntry, reason: str, keep: int = 100_000) -> None:
        """Move a message that failed to decode or validate to the ``dead`` stream, with its reason, raw bytes and
        size (an oversized one never gets here: :meth:`read` dead-letters it with a prefix). The stream keeps about
        the newest ``keep`` (a flood of garbage must not fill Redis); ``groups_dead`` counts every one."""
        payload = entry.payload if entry.payload is not None else b""
        self._dead_script(
            keys=[self.keys.groups, self.keys.stats, self.keys.dead],
            args=[CONSUMER_GROUP, entry.id, reason[:1000], payload, repr(time.time()), keep],
        )


class DeadLetters(Connection):
    """The operator's side (``grpo dead``): reading, counting and replaying dead letters."""

    _replay_script = Lua(_REPLAY)

    def dead_letters(self, count: int, start: str = "-") -> list[DeadLetter]:
        """The oldest ``count`` dead letters from ``start`` (:class:`~common.schemas.DeadLetter`: ``truncated`` when
        the payload is only the first ``DEAD_PREFIX_BYTES`` of an oversized message); SchemaError (one line) for an
        entry that is not a dead letter."""
        return [DeadLetter.from_fields(as_text(i), f) for i, f in self._dead_range(count, start)]

    def dead_letter_ids(self, count: int, start: str = "-") -> list[str]:
        """The ids of the oldest ``count`` dead letters from ``start``, whatever their fields (a replay needs only
        the payload, so a letter this build cannot read whole can still go back)."""
        return [as_text(i) for i, _ in self._dead_range(count, start)]

    def _dead_range(self, count: int, start: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
        reply: Any = self._do(lambda: self.client.xrange(self.keys.dead, min=start, count=count))
        return reply

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
