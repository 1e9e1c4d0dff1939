"""Held-out evaluation, shared by the learner's ``eval/accuracy`` and ``grpo eval``: the same prompts, encoding,
grading and figures whichever model generates (the learner's own, an actor engine, a SGLang server).

For each problem: one greedy answer and, when ``n`` > 0, ``n`` sampled at ``sampling.temperature``, generated
``task.eval_batch`` prompts at a time and graded like the actors grade.

- ``pass_at_1``: the fraction of problems whose greedy answer is right (the learner's ``eval/accuracy``);
- ``mean_at_n``: the mean score over all sampled answers (the usual unbiased estimate of sampled pass@1);
- ``pass_at_n``: the fraction of problems with at least one right answer among the ``n``.

"Right" is the grader's notion of correct (see :func:`correctness`), not a perfect training reward: a reward that
adds a format bonus to correctness would otherwise count a right answer without its tags as wrong.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.config import GraderConfig
from common.rollout import Sample, SampleGrader
from common.tasks.task import Problem

# (prompts, n, greedy, problems) -> n samples per prompt. ``problems`` are what the prompts ask, one each, for an
# environment to be told (env.episodes); () where they are not known (an episode's later turns).
Generate = Callable[[Sequence[Sequence[int]], int, bool, Sequence[Problem]], list[list[Sample]]]


def correctness(grader: GraderConfig) -> GraderConfig:
    """The grader evaluation scores with: whether an answer is right. For ``combine`` that is not its weighted mean
    (with ``gsm8k`` 0.9 and ``format`` 0.1 a right answer without the layout gets 0.9, and only a perfect 1 used to
    count): ``format`` components judge the layout, not the answer, so they are left out and an answer is right when
    every other component gives it 1 (a combine of ``format`` components alone keeps them all). Any other grader is
    its own notion of correct."""
    if grader.name != "combine":
        return grader
    checks = [c for c in grader.components if c.name != "format"]
    return grader.model_copy(update={"components": checks}) if checks else grader


@dataclass
class EvalScores:
    greedy: list[float] = field(default_factory=list)  # one per problem
    sampled: list[list[float]] = field(default_factory=list)  # n per problem; empty lists when n = 0
    errors: Counter[str] = field(default_factory=Counter)


def score_problems(
    problems: Sequence[Problem],
    encode: Callable[[str], list[int]],
    generate: Generate,
    grader: SampleGrader,
    tokenizer: Any,
    *,
    n: int,
    batch: int,
    require_stop: bool,
) -> EvalScores:
    out = EvalScores()
    for start in range(0, len(problems), batch):
        chunk = problems[start : start + batch]
        prompts = [encode(p.prompt) for p in chunk]
        references = [p.reference for p in chunk]
        asked = [p.prompt for p in chunk]
        greedy = generate(prompts, 1, True, chunk)
        g = grader.grade_samples(
            tokenizer, [s[0] for s in greedy], references, require_stop=require_stop, prompts=asked
        )
        out.greedy += g.scores
        out.errors += g.errors
        if n == 0:
            out.sampled += [[] for _ in chunk]
            continue
        sampled = generate(prompts, n, False, chunk)
        flat = [s for group in sampled for s in group]
        r = grader.grade_samples(
            tokenizer,
            flat,
            [ref for ref in references for _ in range(n)],
            require_stop=require_stop,
            prompts=[q for q in asked for _ in range(n)],
        )
        out.sampled += [r.scores[i * n : (i + 1) * n] for i in range(len(chunk))]
        out.errors += r.errors
    return out


def summarise(greedy: Sequence[float], sampled: Sequence[Sequence[float]]) -> dict[str, float]:
    """Pure: the report's figures from each problem's greedy score and its sampled scores (see the module doc)."""
    n_problems = len(greedy)
    figures = {"pass_at_1": sum(1.0 for s in greedy if s >= 1.0) / n_problems}
    if any(sampled):
        figures["mean_at_n"] = sum(sum(s) / len(s) for s in sampled) / n_problems
        figures["pass_at_n"] = sum(1.0 for s in sampled if max(s) >= 1.0) / n_problems
    return figures
