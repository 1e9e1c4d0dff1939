"""Episodes of several turns, sampled in groups: the driver between an engine and an environment.

``Episodes.run`` takes a function that generates one model turn for many contexts (an engine's ``generate``:
token ids in, :class:`Sample` s out) and returns, per prompt, ``n`` whole episodes as samples, so that grading,
DAPO's zero-std filter, the wire and the learner treat an episode as they treat an answer:

- the first turn is sampled ``n`` times per prompt (a group, sharing the prompt's prefix as a single answer does);
  every later turn once per episode, from that episode's context: the prompt, then every token so far;
- a model turn's tokens are the engine's own (ids and behaviour log-probs as it returned them), and the
  environment's turn is appended as the token ids it gave: nothing already in the context is tokenized again, so
  what the learner scores is exactly what was sampled;
- ``Sample.mask`` is 1 on the model's tokens and 0 on the environment's, whose log-probs are NaN (there are none);
  ``Sample.versions`` joins the turns' version runs (an environment token takes the version of the token before
  it; a turn that reports none is its reply's version throughout), always: the group leaves them out where every
  episode is one run of the group's version (actor.message);
  ``Sample.answer_from`` is where the last model turn starts (what the grader scores);
- ``Sample.ended`` says why the episode ended (common.rollout.EpisodeEnd); a ``tool_<kind>`` failure scores it 0.

An episode whose context would leave less than a turn's room in the model's positions ends there (``length``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from common.config import Config, EnvConfig
from common.model.limits import prompt_token_limit
from common.rollout import Sample, merged_runs
from common.tasks import Problem
from common.tasks.evaluation import Generate
from env.custom import load_environment
from env.environment import Environment, ToolEnvironment, Turn

# (contexts, n, greedy) -> (n samples per context, the version the engine reports it generated them with or None)
TurnGenerate = Callable[[Sequence[Sequence[int]], int, bool], tuple[list[list[Sample]], int | None]]


def episode_counts(samples: Sequence[Sample]) -> tuple[Counter[str], int]:
    """How the episodes among ``samples`` ended (common.rollout.EpisodeEnd), and the environment turns they hold
    (tool calls answered); nothing for single answers."""
    ends = Counter(s.ended for s in samples if s.ended)
    calls = sum(1 for s in samples for a, b in pairwise(s.mask) if a == 1 and b == 0)
    return ends, calls


@dataclass
class _Episode:
    context: list[int]  # prompt and every token so far: what the next turn is generated from
    problem: Problem | None = None  # what the prompt asks, for the environment
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    runs: list[tuple[int, int]] = field(default_factory=list)
    finish: str = "length"
    answer_from: int = 0
    turns: int = 0
    ended: str = ""

    def add_turn(self, s: Sample, version: int) -> None:
        self.answer_from = len(self.tokens)
        self.tokens += s.token_ids
        self.context += s.token_ids
        self.logprobs += s.logprobs
        self.mask += [1] * len(s.token_ids)
        self.runs += s.versions or [(version, len(s.token_ids))]
        self.finish = s.finish_reason
        self.turns += 1

    def add_environment(self, ids: Sequence[int]) -> None:
        self.tokens += ids
        self.context += ids
        self.logprobs += [math.nan] * len(ids)
        self.mask += [0] * len(ids)
        self.runs.append((self.runs[-1][0], len(ids)))

    def sample(self) -> Sample:
        written_by_env = 0 in self.mask
        runs = merged_runs(self.runs)
        return Sample(
            self.tokens,
            self.logprobs,
            self.finish,
            # Always the runs: the turns' own where they reported them, else each turn's version (a whole request
            # of one version each, as SGLang serving a LoRA adapter updates in flight). Whether the group can go
            # without them is the group's to say (actor.message): one of its episodes may be older than another.
            runs,
            tuple(self.mask) if written_by_env else (),
            self.answer_from,
            self.ended,
        )


def make_environment(cfg: EnvConfig, tokenizer: Any) -> Environment | None:
    """The run's environment; None for single_turn (one answer per prompt: nothing between the engine and the
    grader); your class for ``module.path:Class`` (env.custom)."""
    if cfg.name == "single_turn":
        return None
    return ToolEnvironment(cfg, tokenizer) if cfg.name == "tool" else load_environment(cfg, tokenizer)


def open_episodes(cfg: Config, tokenizer: Any, stop_ids: set[int]) -> Episodes | None:
    """The run's episodes (``env.name`` tool or your class), None for single answers. ``stop_ids`` (an engine's, or
    the learner's evaluation's) gains the environment's in place: a model turn also stops at a call's closing token
    (both engines send their stop ids with each request). Close the episodes to close the environment (the tool's
    worker)."""
    env = make_environment(cfg.env, tokenizer)
    if env is None:
        return None
    stop_ids |= env.stop_ids
    return Episodes(env, prompt_token_limit(cfg), cfg.env.max_turns)


class Episodes:
    def __init__(self, env: Environment, context_limit: int | None, max_turns: int | None = None):
        self.env = env
        self.context_limit = context_limit  # the longest context a turn may start from (positions − a turn)
        self.max_turns = max_turns  # env.max_turns, which the message size is reckoned from (common.model.limits)

    def close(self) -> None:
        self.env.close()

    def run(
        self,
        generate: TurnGenerate,
        prompts: Sequence[Sequence[int]],
        n: int,
        greedy: bool = False,
        version_now: Callable[[], int] = lambda: 0,
        problems: Sequence[Problem] | None = None,
    ) -> tuple[list[list[Sample]], int | None]:
        """``n`` episodes per prompt (prompt-major), and the version of the engine's last reply that reported one.
        ``problems``, one per prompt, are what the environment is told the prompts ask (Turn.problem)."""
        first, version = generate(prompts, n, greedy)
        episodes: list[_Episode] = []
        asked = problems if problems is not None else [None] * len(prompts)
        for prompt, problem, group in zip(prompts, asked, first, strict=True):
            for s in group:
                episodes.append(_Episode(list(prompt), problem))
                episodes[-1].add_turn(s, version if version is not None else version_now())
        going = episodes
        while going := self._respond(going):
            replies, v = generate([e.context for e in going], 1, greedy)
            version = v if v is not None else version
            for e, group in zip(going, replies, strict=True):
                e.add_turn(group[0], v if v is not None else version_now())
        samples = [e.sample() for e in episodes]
        return [samples[i : i + n] for i in range(0, len(samples), n)], version

    def _respond(self, episodes: list[_Episode]) -> list[_Episode]:
        """The environment's turn for each episode; returns those that go on to another model turn."""
        responses = self.env.respond([Turn(e.tokens[e.answer_from :], e.finish, e.turns, e.problem) for e in episodes])
        going = []
        for e, r in zip(episodes, responses, strict=True):
            if r.ended or not r.token_ids:
                e.ended = r.ended or "answer"
            elif self.max_turns is not None and e.turns >= self.max_turns:  # the tool ends these itself; every
                e.ended = "max_turns"  # environment is held to it here
            elif self.context_limit is not None and len(e.context) + len(r.token_ids) > self.context_limit:
                e.ended, e.finish = "length", "length"
            else:
                e.add_environment(r.token_ids)
                going.append(e)
        return going


def episode_generate(episodes: Episodes | None, generate: Generate) -> Generate:
    """An evaluation's generate function (common.tasks.evaluation) that returns whole episodes; ``generate`` itself
    without an environment."""
    if episodes is None:
        return generate
    run = episodes.run

    def whole(
        prompts: Sequence[Sequence[int]], n: int, greedy: bool, problems: Sequence[Problem]
    ) -> list[list[Sample]]:
        def turn(contexts: Sequence[Sequence[int]], k: int, g: bool) -> tuple[list[list[Sample]], int | None]:
            return generate(contexts, k, g, ()), None

        return run(turn, prompts, n, greedy, problems=problems)[0]

    return whole
