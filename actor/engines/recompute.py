"""``actor.in_flight_kv: recompute`` for an engine in this process: a round is sampled until a new version is due,
every unfinished answer then stops, the version is loaded, and the answers go on from a fresh prefill of prompt and
answer so far with the new weights, so that no token after the load attends to keys or values computed with the
old ones. Rows of one ``generate`` call advance in step, so every answer that stops has as many tokens as the
others: the continuation gets the rest of the token budget. Pure, given the engine's ``generate`` and the updates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from actor.engines.base import Updates
from common.rollout import Sample, merged_runs

# generate(prompts, n, max_new_tokens, interrupt) -> n samples per prompt, prompt-major
Generate = Callable[[Sequence[Sequence[int]], int, int, Callable[[], bool]], list[list[Sample]]]


def unfinished(sample: Sample, limit: int) -> bool:
    """Stopped by an interruption: neither at a stop token nor at the token budget."""
    return sample.finish_reason == "length" and len(sample.token_ids) < limit


def joined(head: Sample, tail: Sample) -> Sample:
    """An answer's tokens before the load and after it, as one sample (the version runs meeting where they may)."""
    runs = merged_runs((*head.versions, *tail.versions))
    return Sample(head.token_ids + tail.token_ids, head.logprobs + tail.logprobs, tail.finish_reason, runs)


def generate_recomputing(
    generate: Generate, prompts: Sequence[Sequence[int]], n: int, limit: int, updates: Updates
) -> list[list[Sample]]:
    """``n`` samples per prompt within ``limit`` new tokens, every version due meanwhile loaded between two steps
    and the unfinished answers' keys and values recomputed with it."""
    flat = [s for group in generate(prompts, n, limit, updates.due) for s in group]
    while rows := [i for i, s in enumerate(flat) if unfinished(s, limit)]:
        updates.load()
        done = len(flat[rows[0]].token_ids)  # the same for every row: they advanced in step
        more = generate([[*prompts[i // n], *flat[i].token_ids] for i in rows], 1, limit - done, updates.due)
        for i, (tail,) in zip(rows, more, strict=True):
            flat[i] = joined(flat[i], tail)
    return [flat[i : i + n] for i in range(0, len(flat), n)]
