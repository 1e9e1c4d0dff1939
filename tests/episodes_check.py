"""What every engine's episodes must satisfy, checked token by token (tests/integration/test_episode_engines.py and
the real-SGLang test): each model turn is exactly what the engine returned for exactly the context before it, the
environment's tokens sit between them, and the behaviour log-probs of the model's tokens are what the learner
computes for the whole episode, so the learner trains on what was sampled."""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import groupby
from typing import Any

import torch

from common.grpo.logprobs import token_logprobs
from common.rollout import Sample
from env.environment import ToolEnvironment
from env.episodes import Episodes


class Recorder:
    """Wraps an engine's turn function: every call's contexts, ``n`` and samples."""

    def __init__(self, turn: Any):
        self.turn = turn
        self.calls: list[tuple[list[list[int]], int, list[list[Sample]]]] = []

    def __call__(self, contexts: Sequence[Sequence[int]], n: int, greedy: bool) -> Any:
        groups, version = self.turn(contexts, n, greedy)
        self.calls.append(([list(c) for c in contexts], n, groups))
        return groups, version

    def replies(self) -> dict[tuple[int, ...], list[Sample]]:
        """Each context the engine was given, and what it returned for it."""
        out: dict[tuple[int, ...], list[Sample]] = {}
        for contexts, _, groups in self.calls:
            for c, g in zip(contexts, groups, strict=True):
                out.setdefault(tuple(c), []).extend(g)
        return out


def segments(sample: Sample) -> list[tuple[int, int, int]]:
    """(writer, start, end) runs of the mask: 1 the model, 0 the environment."""
    mask = sample.mask or (1,) * len(sample.token_ids)
    out, start = [], 0
    for writer, run in groupby(mask):
        k = len(list(run))
        out.append((writer, start, start + k))
        start += k
    return out


def check_turns(recorder: Recorder, prompt: list[int], sample: Sample) -> int:
    """Every model turn of ``sample`` is one the engine returned for the context before it, id for id and log-prob
    for log-prob; returns the number of environment turns."""
    replies = recorder.replies()
    env_turns = 0
    for writer, start, end in segments(sample):
        if writer == 0:
            env_turns += 1
            assert all(math.isnan(x) for x in sample.logprobs[start:end])
            continue
        context = tuple(prompt + sample.token_ids[:start])
        given = replies.get(context)
        assert given is not None, f"no turn was generated from the context before token {start}"
        turn = sample.token_ids[start:end]
        match = [s for s in given if s.token_ids == turn and s.logprobs == sample.logprobs[start:end]]
        assert match, f"tokens {start}:{end} are not what the engine returned for their context"
    return env_turns


def learner_gap(model: Any, prompt: list[int], sample: Sample, temperature: float) -> list[float]:
    """|behaviour − learner| log-prob of each model token, the learner scoring the whole episode in one forward."""
    ids = torch.tensor([prompt + sample.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    learner = token_logprobs(logits, torch.tensor(sample.token_ids), temperature).tolist()
    mask = sample.mask or (1,) * len(sample.token_ids)
    return [abs(b - x) for b, x, m in zip(sample.logprobs, learner, mask, strict=True) if m]


def run_episodes(engine: Any, cfg: Any, turn: Any) -> tuple[list[list[int]], Any, Recorder]:
    """Groups of 8 episodes on four prompts with ``cfg.env``'s tool, every engine call recorded."""
    env = ToolEnvironment(cfg.env, engine.tokenizer)
    engine.stop_ids |= env.stop_ids
    prompts = [engine.tokenizer.encode(t) for t in ("3+5=", "12+7=", "4+4=", "9*9=")]
    recorder = Recorder(turn)
    try:
        groups, _ = Episodes(env, context_limit=100).run(recorder, prompts, 8)
    finally:
        env.close()
    return prompts, groups, recorder
