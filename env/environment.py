"""Environments: what answers a model's turn in an episode (``env.name``).

An episode starts from a prompt and alternates model turns and environment turns (a tool's result, feedback) until
the environment ends it; its reward is the grader's score of the model's last turn. Token in, token out: the model's
turns are the exact token ids its engine produced, never decoded and encoded again, and an environment answers with
token ids of its own (its text tokenized alone), which the episode appends (env.episodes). The per-token mask
that results says which tokens the model wrote (trained, with their behaviour log-probs) and which the environment
wrote (never trained).

``single_turn`` (the default) is no environment at all: one answer per prompt, graded, as the project always did, at
the same speed. ``tool``: :class:`ToolEnvironment`. Your own environment implements :class:`Environment` and is
chosen as ``module.path:Class`` (env.custom).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from common.config import ConfigError, EnvConfig
from common.tasks import Problem
from env.tools import ToolPool


@dataclass(frozen=True)
class Turn:
    token_ids: Sequence[int]  # the model's turn, as its engine produced it
    finish_reason: str  # "stop" (end-of-sequence or one of the environment's stop ids) or "length"
    number: int  # 1 for the first turn of the episode
    problem: Problem | None = None  # what the episode's prompt asks (its text and reference); None where unknown


@dataclass(frozen=True)
class Response:
    """The environment's turn to append (token ids), or the episode's end: ``ended`` says why
    (common.rollout.EpisodeEnd; a ``tool_<kind>`` failure scores the episode 0)."""

    token_ids: tuple[int, ...] = ()
    ended: str = ""


class Environment(Protocol):
    stop_ids: set[int]  # tokens that end a model turn besides end-of-sequence (a call's closing token)

    def respond(self, turns: list[Turn]) -> list[Response]:
        """One response per turn, in order. Called from the threads that generate rounds: must be thread-safe (a
        class chosen as ``env.name: module.path:Class`` is called one call at a time, env.custom)."""
        ...

    def close(self) -> None: ...


class ToolEnvironment:
    """A model turn that ends with ``env.call_close`` is a call: the text after its last ``env.call_open`` goes to
    ``env.tool`` (in a worker, env.tools), and ``env.result_template`` of the result is the environment's turn. A
    turn that ends otherwise (end-of-sequence, the length limit) is the answer, and ends the episode; so does a call
    in turn ``env.max_turns`` (``max_turns``) and a call that fails (``tool_<kind>``, scored 0)."""

    def __init__(self, cfg: EnvConfig, tokenizer: Any):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.close_id = call_close_id(cfg, tokenizer)
        self.stop_ids = {self.close_id}
        try:
            self.pool = ToolPool(cfg.tool, timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb,
                                 max_chars=cfg.max_result_chars)  # fmt: skip
        except KeyError as e:
            raise ConfigError(f"config error: env.tool: {e.args[0]}") from None
        self._lock = threading.Lock()  # one worker; rounds in flight call from their own threads

    def respond(self, turns: list[Turn]) -> list[Response]:
        out: list[Response | None] = [None] * len(turns)
        calls: list[tuple[int, str]] = []
        for i, turn in enumerate(turns):
            if turn.finish_reason != "stop" or not turn.token_ids or turn.token_ids[-1] != self.close_id:
                out[i] = Response(ended="length" if turn.finish_reason == "length" else "answer")
            elif turn.number >= self.cfg.max_turns:
                out[i] = Response(ended="max_turns")
            else:
                calls.append((i, self.call_text(turn.token_ids)))
        with self._lock:
            results = self.pool.call([text for _, text in calls])
        for (i, _), result in zip(calls, results, strict=True):
            if result.text is None:
                out[i] = Response(ended=f"tool_{result.error}")
            else:
                text = self.cfg.result_template.format(result=result.text)
                out[i] = Response(tuple(self.tokenizer.encode(text, add_special_tokens=False)))
        return [r for r in out if r is not None]

    def call_text(self, token_ids: Sequence[int]) -> str:
        """What the tool gets: the turn's text before its closing token, after its last ``env.call_open`` (the whole
        text when it has none). Decoded for the tool only: the episode keeps the token ids."""
        text = self.tokenizer.decode(list(token_ids[:-1]), skip_special_tokens=True)
        return text.rpartition(self.cfg.call_open)[2]

    def close(self) -> None:
        self.pool.close()


def call_close_id(cfg: EnvConfig, tokenizer: Any) -> int:
    """The token a call ends with; ConfigError naming ``env.call_close`` when it is not exactly one token."""
    close = tokenizer.encode(cfg.call_close, add_special_tokens=False)
    if len(close) != 1:
        raise ConfigError(
            f"config error: env.call_close: {cfg.call_close!r} is {len(close)} tokens of this model's tokenizer; "
            "a model turn stops at one token, so it must be exactly one"
        )
    return int(close[0])
