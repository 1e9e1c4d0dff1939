"""Your own environment, chosen from the config: ``env.name: module.path:Class``.

The class implements :class:`env.environment.Environment` and is built as ``Class(tokenizer, **env.args)`` in every
process that samples episodes: each actor, and the learner's and ``grpo eval``'s held-out evaluation. Its module
must be importable there (installed, on ``PYTHONPATH``, or in the working directory, common.cli). It runs inside
that process, trusted as the config is: code it must not trust (what the model wrote) belongs in a tool's worker
(env.tools), not in ``respond`` itself.

What the episode driver (env.episodes) holds any environment to, and what this module adds for yours:

- ``respond`` is called from the threads that generate rounds; yours is called under a lock, one call at a time, so
  it need not be thread-safe;
- a ``respond`` that raises ends every episode of that call with ``tool_exception``, and one that returns anything
  but one reply per turn ends them with ``tool_invalid``; a reply that is not a :class:`~env.environment.Response`,
  is longer than ``env.max_response_tokens``, holds token ids that are not integers in the tokenizer's range or an
  ``ended`` outside common.rollout.EpisodeEnd ends its own episode with ``tool_invalid``. Each scores 0 and is
  counted (``grpo_actor_episodes{end=...}``, the actor's last log line) as a tool's failures are; the run goes on.
  The first failure of each kind is logged with its reason;
- a model turn after which the environment would answer again but the episode has had ``env.max_turns`` turns ends
  it (``max_turns``).
"""

from __future__ import annotations

import logging
import operator
import threading
from collections.abc import Sequence
from typing import Any

from common.config import ConfigError, EnvConfig
from common.rollout import END_REASONS
from env.environment import Environment, Response, Turn
from grader import import_function

log = logging.getLogger(__name__)


def load_environment(cfg: EnvConfig, tokenizer: Any) -> Environment:
    """Your class built from ``env.name`` and ``env.args``, guarded (see the module docstring); ConfigError naming
    the field when it cannot be imported or built."""
    try:
        cls = import_function(cfg.name, "environment", "single_turn, tool")  # a class is called as a function is
    except KeyError as e:
        raise ConfigError(f"config error: env.name: {e.args[0]}") from None
    try:
        env = cls(tokenizer, **cfg.args)
    except Exception as e:  # a constructor's refusal is the config's mistake: say so in one line
        raise ConfigError(f"config error: env.args: {cfg.name} refused them: {type(e).__name__}: {e}") from None
    missing = [a for a in ("stop_ids", "respond", "close") if not hasattr(env, a)]
    if missing:
        raise ConfigError(f"config error: env.name: {cfg.name} is not an Environment (it has no {', '.join(missing)})")
    return Guarded(env, cfg.name, cfg.max_response_tokens, len(tokenizer))


class Guarded:
    """A user's environment, one ``respond`` at a time, its failures turned into episode ends (module docstring)."""

    def __init__(self, env: Environment, name: str, max_tokens: int, vocab: int):
        self.env = env
        self.name = name
        self.max_tokens = max_tokens
        self.vocab = vocab  # an id past the tokenizer's would crash the engine that samples the next turn
        self.stop_ids: set[int] = {int(i) for i in env.stop_ids}
        self._lock = threading.Lock()
        self._logged: set[str] = set()

    def respond(self, turns: list[Turn]) -> list[Response]:
        with self._lock:
            try:
                replies = self.env.respond(turns)
            except Exception as e:
                return self._failed(turns, "tool_exception", f"respond raised {type(e).__name__}: {e}")
            if isinstance(replies, (str, bytes)) or not isinstance(replies, Sequence) or len(replies) != len(turns):
                why = f"respond returned {type(replies).__name__}, not a list of {len(turns)} Responses"
                return self._failed(turns, "tool_invalid", why)
            return [self._checked(r) for r in replies]  # one bad reply ends its own episode, not its neighbours'

    def _checked(self, r: Any) -> Response:
        """``r`` as the episode driver takes it (token ids a tuple of ints), or the end of its episode, invalid."""
        try:
            return self._response(r)
        except _Invalid as e:
            return self._failed([r], "tool_invalid", str(e))[0]

    def _response(self, r: Any) -> Response:
        if not isinstance(r, Response):
            raise _Invalid(f"respond returned a {type(r).__name__} among its Responses")
        if r.ended and r.ended not in END_REASONS:
            raise _Invalid(f"a response ended {r.ended!r}, not one of {', '.join(END_REASONS)}")
        ids = r.token_ids
        if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Sequence):  # bytes: text.encode(), not ids
            raise _Invalid(f"a response's token_ids are a {type(ids).__name__}, not a sequence of token ids")
        if len(ids) > self.max_tokens:
            raise _Invalid(f"a response of {len(ids)} tokens, over env.max_response_tokens={self.max_tokens}")
        tokens = _integers(ids)
        if tokens is None or not all(0 <= t < self.vocab for t in tokens):
            raise _Invalid(f"a response's token_ids are not all ids of this tokenizer (integers in [0, {self.vocab}))")
        return Response(tokens, r.ended)

    def _failed(self, turns: Sequence[Turn], end: str, why: str) -> list[Response]:
        if end not in self._logged:  # once per kind (under the lock): a broken environment fails every call alike
            self._logged.add(end)
            log.warning("environment %s: %s; its episodes end %s, scored 0 (counted; logged once)", self.name, why, end)
        return [Response(ended=end) for _ in turns]

    def close(self) -> None:
        self.env.close()


class _Invalid(Exception):
    """What a user's environment returned that cannot be an environment's turn (why, in one line)."""


def _integers(values: Sequence[Any]) -> tuple[int, ...] | None:
    """``values`` as ints (numpy's and torch's integers are ids too), or None when one is not an integer (a bool, a
    float, a string)."""
    out = []
    for v in values:
        if isinstance(v, bool):
            return None
        try:
            out.append(operator.index(v))
        except TypeError:
            return None
    return tuple(out)
