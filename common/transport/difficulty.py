"""The run's record of what each training problem still teaches (part of common.transport), for
``actor.prompt_sampling: difficulty`` (actor.difficulty):

- ``prompts:record``, a hash: problem id → its recent outcomes, one character per group (``m`` informative, ``r``
  all right, ``w`` all wrong), oldest first, at most ``actor.difficulty_window`` of them. Bounded by the training
  set: one field per problem ever drawn.
- ``prompts:choices``, a hash of counts: ``taken:<pool>`` and ``passed:<pool>``, how many cursor positions the
  actors took or passed over, by the problem's pool when they did (``grpo status`` shows them).

Both are written in one script per round, by the actor that graded it, after its round is sent: a history is a
sampling hint, not accounting (a retried script may count a round twice; a Redis that lost them makes every
problem unseen again, and drawing falls back to the cursor's order until groups are graded anew).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from common.schemas import as_text
from common.transport.connection import Connection, Lua

_RECORD = """
local window = tonumber(ARGV[1])
local n = tonumber(ARGV[2])
local i = 3
for _ = 1, n do
  local history = (redis.call('HGET', KEYS[1], ARGV[i]) or '') .. ARGV[i + 1]
  if #history > window then history = string.sub(history, -window) end
  redis.call('HSET', KEYS[1], ARGV[i], history)
  i = i + 2
end
while i < #ARGV do
  redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1])
  i = i + 2
end
return n
"""

OUTCOME_CHARACTERS = frozenset("mrw")


def history_text(raw: Any, window: int) -> str:
    """A stored history as the sampler reads it: its outcome characters only, the newest ``window`` of them (a
    value some other writer left is read for what it holds, never trusted whole)."""
    if raw is None:
        return ""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    return "".join(c for c in text if c in OUTCOME_CHARACTERS)[-window:]


class ProblemRecords(Connection):
    """The actors' side: read the histories of the problems a round may draw, and add a round's outcomes."""

    _record_script = Lua(_RECORD)

    def histories(self, ids: Sequence[str], window: int) -> list[str]:
        if not ids:
            return []
        raw = self._do(lambda: self.client.hmget(self.keys.prompts_record, list(ids)))
        return [history_text(r, window) for r in raw]

    def record_outcomes(self, outcomes: Sequence[tuple[str, str]], window: int, counts: Mapping[str, int]) -> None:
        """Append each ``(problem id, outcome)`` to its history, keeping the newest ``window``, and add ``counts``
        to ``prompts:choices``; one script."""
        counted = {k: n for k, n in counts.items() if n}
        if not outcomes and not counted:
            return
        args: list[Any] = [window, len(outcomes)]
        for problem_id, o in outcomes:
            args += [problem_id, o]
        for name, n in counted.items():
            args += [name, n]
        keys = [self.keys.prompts_record, self.keys.prompts_choices]
        self._do(lambda: self._record_script(keys=keys, args=args))


def choices_of(kind: str, choices: Mapping[str, int]) -> dict[str, int]:
    """The counts of one kind (``taken`` or ``passed``) of ``prompts:choices``, by pool."""
    return {k.split(":", 1)[1]: n for k, n in choices.items() if k.startswith(kind + ":")}


class ProblemRecordsReading(Connection):
    """What anyone may read of it: how many problems it holds and the choices counted."""

    def sampling_choices(self) -> tuple[int, dict[str, int]]:
        """``(problems on record, {"taken:<pool>" | "passed:<pool>": count})``."""

        def build(pipe: Any) -> None:
            pipe.hlen(self.keys.prompts_record)
            pipe.hgetall(self.keys.prompts_choices)

        n, choices = self._batch(build, transaction=False)
        return int(n), {as_text(k): int(v) for k, v in choices.items() if v.isdigit()}  # another writer's: skipped
