"""Your own environment, chosen from the config: ``env.name: module.path:Class``.

The class implements :class:`env.environment.Environment` and is built as ``Class(tokenizer, **env.args)`` in every
process that samples episodes: each actor, and the learner's and ``grpo eval``'s held-out evaluation. Its module
must be importable there (installed, or on ``PYTHONPATH``). It runs inside that process, trusted as the config is:
code it must not trust (what the model wrote) belongs in a tool's worker (env.tools), not in ``respond`` itself.

What the episode driver (env.episodes) holds any environment to, and what this module adds for yours:

- ``respond`` is called from the threads that generate rounds; yours is called under a lock, one call at a time, so
  it need not be thread-safe;
- a ``respond`` that raises ends every episode of that call with ``tool_exception``, and one that returns anything
  but one :class:`~env.environment.Response` per turn, or a turn longer than ``env.max_response_tokens``, ends them
  with ``tool_invalid`` (so does a token id outside the tokenizer's, or an ``ended`` outside
  common.rollout.EpisodeEnd): scored 0 and counted (``grpo_actor_episodes{end=...}``, the actor's last log line) as a
  tool's failures are, the run goes on. The first failure of each kind is logged with its reason;
- a model turn after which the environment would answer again but the episode has had ``env.max_turns`` turns ends
  it (``max_turns``).
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

from common.config import ConfigError, EnvConfig
from common.rollout import END_REASONS
from env.environment import Environment, Response, Turn

log = logging.getLogger(__name__)


def load_environment(cfg: EnvConfig, tokenizer: Any) -> Environment:
    """Your class built from ``env.name`` and ``env.args``, guarded (see the module docstring); ConfigError naming
    the field when it cannot be imported or built."""
    module, _, attr = cfg.name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"config error: env.name: {cfg.name!r} cannot be imported: {e}") from None
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
        try:
            with self._lock:
                responses = self.env.respond(turns)
        except Exception as e:
            return self._failed(turns, "tool_exception", f"respond raised {type(e).__name__}: {e}")
        problem = self._problem(turns, responses)
        if problem:
            return self._failed(turns, "tool_invalid", problem)
        return list(responses)

    def _problem(self, turns: Sequence[Turn], responses: Any) -> str:
        """Why ``responses`` cannot answer ``turns``, or ""."""
        if not isinstance(responses, Sequence) or len(responses) != len(turns):
            return f"respond returned {type(responses).__name__}, not a list of {len(turns)} Responses"
        for r in responses:
            if not isinstance(r, Response):
                return f"respond returned a {type(r).__name__} among its Responses"
            if len(r.token_ids) > self.max_tokens:
                return f"a response of {len(r.token_ids)} tokens, over env.max_response_tokens={self.max_tokens}"
            if not all(isinstance(t, int) and 0 <= t < self.vocab for t in r.token_ids):
                return f"a response whose token_ids are not all ids of this tokenizer (ints in [0, {self.vocab}))"
            if r.ended and r.ended not in END_REASONS:
                return f"a response ended {r.ended!r}, not one of {', '.join(END_REASONS)}"
        return ""

    def _failed(self, turns: Sequence[Turn], end: str, why: str) -> list[Response]:
        if end not in self._logged:  # once per kind: a broken environment fails every call alike
            self._logged.add(end)
            log.warning("environment %s: %s; its episodes end %s, scored 0 (counted; logged once)", self.name, why, end)
        return [Response(ended=end) for _ in turns]

    def close(self) -> None:
        self.env.close()
