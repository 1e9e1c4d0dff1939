"""What a rollout is, whichever engine sampled it and whatever grades it: a :class:`Sample` (one answer, or one episode
of several turns) with the version runs of the weights that produced its tokens, the mask of who wrote each and why
an episode ended (:data:`EpisodeEnd`); and what grading samples gives (:class:`GradeResult`, its error kinds
:data:`GraderErrorKind`) from any :class:`SampleGrader` (the grader's worker pool, a scoring service). Torch-free, so
that the grader, the SGLang request module and the wire import it without loading torch or transformers; sampling
with transformers itself is common.model.generation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args

# How an episode ended (env.episodes; the label values of grpo_actor_episodes_total): answer, the model answered (no
# call); max_turns, it called in its last turn; length, a turn hit sampling.max_new_tokens or the context the model's
# positions; tool_<kind>, the call failed (env.tools), which scores the episode 0.
EpisodeEnd = Literal[
    "answer", "max_turns", "length", "tool_timeout", "tool_crash", "tool_memory", "tool_exception", "tool_invalid"
]
END_REASONS: tuple[str, ...] = get_args(EpisodeEnd)
TOOL_FAILURES = tuple(r for r in END_REASONS if r.startswith("tool_"))

# Why an answer (or a tool's call) scored 0 without being judged (the label values of grpo_actor_grader_errors_total).
# grader.name=service adds its own: a batch that timed out, found no server, got an HTTP error or an answer that is not
# {"scores": [...]} of the right length, after its retries (docs/tasks.md: Rewards from a service).
GraderErrorKind = Literal[
    "timeout",
    "memory",  # past the worker's memory limit (grader.memory_mb, env.memory_mb)
    "exception",
    "invalid",
    "crash",
    "service_timeout",
    "service_unreachable",
    "service_http",
    "service_invalid",
    "service_budget",  # not sent: the round's grader.round_budget_s was spent before its batch's turn
]


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    # (version, tokens) runs of the weights that produced its tokens, oldest first, when it was asked for (weights
    # loaded mid-generation: actor.weight_updates in_flight); empty: every token came from the round's version.
    versions: tuple[tuple[int, int], ...] = ()
    # An episode of several turns (env.episodes): per token 1 where the model wrote it, 0 where the environment
    # did (a tool's result: its log-prob is NaN, it is never trained on); empty: every token is the model's.
    mask: tuple[int, ...] = ()
    answer_from: int = 0  # where the model's last turn starts: the text the grader sees
    ended: str = ""  # why the episode ended (EpisodeEnd); "" for a single answer

    @property
    def tool_failed(self) -> bool:
        """An episode a tool's failure ended: it scores 0, whatever its last turn says."""
        return self.ended in TOOL_FAILURES


def version_runs(versions: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Per-token versions → (version, tokens) runs: ``[3, 3, 4]`` → ``((3, 2), (4, 1))``."""
    return merged_runs((v, 1) for v in versions)


def merged_runs(runs: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """(version, tokens) runs, neighbours of one version joined: ``((3, 1), (3, 2), (4, 1))`` → ``((3, 3), (4, 1))``."""
    out: list[tuple[int, int]] = []
    for v, k in runs:
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + k)
        else:
            out.append((v, k))
    return tuple(out)


def completion_text(tokenizer: Any, token_ids: Sequence[int], finish_reason: str) -> str:
    """The text a grader sees: the completion without its final stop token. Other special tokens stay visible, so a
    completion that hides junk tokens (``8<pad>``) is not mistaken for a clean answer."""
    body = token_ids[:-1] if finish_reason == "stop" else token_ids
    return tokenizer.decode(list(body), skip_special_tokens=False)


@dataclass
class GradeResult:
    """One score per answer, and the answers that scored 0 unjudged counted by kind (:data:`GraderErrorKind`)."""

    scores: list[float]
    errors: Counter[str] = field(default_factory=Counter)

    def put(self, i: int, score: float, kind: str | None) -> None:
        """Answer ``i``'s score, and its error counted when there is one."""
        self.scores[i] = score
        if kind:
            self.errors[kind] += 1


class SampleGrader(Protocol):
    """What grades an actor's samples and the held-out evaluation's: grader.pool.GraderPool (a grader function in a
    worker process) and grader.service.ServiceGrader (a scoring service); grader.open.open_grader gives the one
    configured."""

    def grade_samples(
        self,
        tokenizer: Any,
        samples: Sequence[Sample],
        references: Sequence[str],
        *,
        require_stop: bool,
        prompts: Sequence[str] | None = None,
    ) -> GradeResult:
        """One score per sample, and the grader errors counted by kind: the grader sees each sample's text
        (:func:`sample_texts`); with ``require_stop`` an answer cut off at the length limit scores 0, and so does an
        episode a tool's failure ended. ``prompts`` (one per sample) for graders that read the question."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> SampleGrader: ...

    def __exit__(self, *exc: object) -> None: ...


def sample_texts(tokenizer: Any, samples: Sequence[Sample]) -> list[str]:
    """The text graded for each sample: its completion without the stop token; an episode's, its last model turn (the
    answer, after the calls and their results). Every grader takes its texts from here alone."""
    return [completion_text(tokenizer, s.token_ids[s.answer_from :], s.finish_reason) for s in samples]


def unjudged_zeros(samples: Sequence[Sample], result: GradeResult, *, require_stop: bool) -> GradeResult:
    """``result`` with 0 for each sample that earns nothing whatever its text scored: one that did not stop (cut off
    at the length limit) when ``require_stop``, and an episode a tool's failure ended (counted by the actor as its
    end)."""
    result.scores = [
        0.0 if (require_stop and s.finish_reason != "stop") or s.tool_failed else r
        for s, r in zip(samples, result.scores, strict=True)
    ]
    return result
