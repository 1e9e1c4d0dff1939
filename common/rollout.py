"""What a rollout is, whichever engine sampled it: a :class:`Sample` (one answer, or one episode of several turns) with
the version runs of the weights that produced its tokens and the mask of who wrote each. Torch-free, so that the
grader's pool, the SGLang request module and the wire import it without loading torch or transformers; sampling with
transformers itself is common.model.generation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


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
    ended: str = ""  # why the episode ended (env.episodes.EpisodeEnd); "" for a single answer


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
