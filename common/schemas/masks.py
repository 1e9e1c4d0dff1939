"""Which tokens of each completion the model wrote and which the environment did (multi-turn, tool-using episodes):
part of the group message (common.schemas.group), optional since schema version 5.

An episode's completion is the model's turns and the environment's (tool output) after the prompt, end to end. The
learner feeds the model all of them (it conditions on the tool's output), but trains on the model's alone: the
environment's have no behaviour log-prob (the actor writes NaN there) and stay out of the loss and of every
per-token figure. In memory a completion's ``mask`` is uint8 (L,), 1 where the model wrote the token and 0 where the
environment did. On the wire it is one optional map inside ``completions``, run-length encoded as ``versions`` is
(common.schemas.versions), since an episode has a few turns whatever its length::

    "mask": {"runs": array (G,), "value": array (R,), "tokens": array (R,)}

``runs[i]`` is how many runs completion ``i`` has (R = Σ runs), then each run's value (1 model, 0 environment) and
token count, completion after completion. Every run has at least one token, a completion's runs add up to its length,
and each completion has at least one model token (an answer the model wrote nothing of is not an answer). Sent only
when some token of the group is the environment's; absent (every earlier message too), every token is the model's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from common.schemas.fields import SchemaError

UINT8, INT32 = np.dtype(np.uint8), np.dtype(np.int32)
MASK_KEYS = {"runs", "value", "tokens"}


def joined_mask(masks: Sequence[np.ndarray | None], lengths: np.ndarray) -> np.ndarray | None:
    """The group's mask column (N,) from each completion's (None: all its tokens the model's); None when every token
    of the group is the model's, so that a group of plain answers carries nothing."""
    if all(m is None for m in masks):
        return None
    parts = []
    for i, (m, n) in enumerate(zip(masks, lengths.tolist(), strict=True)):
        part = np.ones(n, UINT8) if m is None else np.asarray(m, dtype=UINT8).reshape(-1)
        if len(part) != n:  # caught here, where the actor built it, rather than as a dead letter at the learner
            raise ValueError(f"completion {i}: a mask of {len(part)} for {n} tokens")
        parts.append(part)
    out = np.concatenate(parts)
    return None if out.all() else out


def mask_runs(mask: np.ndarray, offsets: np.ndarray) -> dict[str, np.ndarray]:
    """The wire form of a group's mask column: its runs, a new one wherever the value changes or a completion
    starts (``offsets``: int64 (G + 1,), where each completion starts in the column)."""
    n = len(mask)
    start = np.ones(n, dtype=bool)
    start[1:] = mask[1:] != mask[:-1]
    firsts = offsets[:-1]
    start[firsts[firsts < n]] = True
    starts = np.flatnonzero(start)
    return {
        "runs": np.diff(np.searchsorted(starts, offsets)).astype(INT32),
        "value": mask[starts].astype(INT32),
        "tokens": np.diff(np.append(starts, n)).astype(INT32),
    }


def mask_from_runs(
    d: dict[str, Any], decode: Callable[[Any, str], np.ndarray], lengths: np.ndarray
) -> np.ndarray | None:
    """The mask column (N,) the wire's runs describe, checked against the completions' ``lengths``; ``decode`` is the
    group module's array decoder. None when every run is the model's (nothing to mask)."""
    where = "completions.mask"
    counts, values, tokens = (decode(d[k], f"{where}.{k}") for k in ("runs", "value", "tokens"))
    g, r = len(lengths), len(values)
    if len(counts) != g:
        raise SchemaError(f"{where}: {len(counts)} run counts for {g} completions")
    if len(tokens) != r:
        raise SchemaError(f"{where}: {r} values but {len(tokens)} token counts")
    if counts.min() < 1 or int(counts.sum(dtype=np.int64)) != r:
        raise SchemaError(f"{where}: run counts must be >= 1 and add up to the {r} runs")
    if tokens.min() < 1:
        raise SchemaError(f"{where}: every run has at least one token")
    if not ((values == 0) | (values == 1)).all():
        bad = int(values[(values != 0) & (values != 1)][0])
        raise SchemaError(f"{where}: values are 1 (the model's tokens) or 0 (the environment's), got {bad}")
    starts = np.zeros(g, dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    sums = np.add.reduceat(tokens.astype(np.int64), starts)
    if (bad_len := np.flatnonzero(sums != lengths)).size:
        i = int(bad_len[0])
        raise SchemaError(f"completions[{i}].mask: runs of {int(sums[i])} tokens for {int(lengths[i])}")
    model = np.add.reduceat(values.astype(np.int64) * tokens, starts)
    if (none := np.flatnonzero(model < 1)).size:
        raise SchemaError(f"completions[{int(none[0])}].mask: no token of the model's (an answer needs at least one)")
    return None if values.all() else np.repeat(values.astype(UINT8), tokens)


def checked_logprobs(logprobs: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """The log-probs the group's range check reads: an environment token's NaN (it has no behaviour log-prob) as 0,
    a model token's NaN as it is, so that the check refuses it."""
    if mask is None:
        return logprobs
    return np.where((mask == 0) & np.isnan(logprobs), np.float32(0.0), logprobs)
