"""A group's completions, as the group message carries them and the learner reads them (part of the wire package,
common.schemas): one completion at a time (:class:`Completion`, what an actor builds), or all of them as columns
(:class:`Completions`: lengths, token ids and log-probs end to end, rewards, finish reasons, and the optional version
runs and environment mask); and the summary of groups filtered out (:class:`FilteredStats`). The message itself, its
encoding and its decoding are common.schemas.group."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, overload

import numpy as np

from common.schemas.masks import joined_mask
from common.schemas.versions import VersionRuns

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: frozenset[str] = frozenset({"stop", "length", "abort"})

# The in-memory dtypes of token ids and log-probs, whatever they travelled as.
INT32, FLOAT32 = np.dtype(np.int32), np.dtype(np.float32)


@dataclass(frozen=True)
class Completion:
    token_ids: np.ndarray  # int32 (L,)
    logprobs: np.ndarray  # float32 (L,): behaviour log-probs of the sampled tokens, at the sampling temperature
    reward: float
    finish_reason: FinishReason
    # int32 (k, 2): the (version, tokens) runs of its tokens, oldest first (common.schemas.versions); None: every
    # token is its group's policy_version's.
    runs: np.ndarray | None = None
    # uint8 (L,): 1 where the model wrote the token, 0 where the environment did (a tool's output: its log-prob is
    # NaN, and it is never trained on; common.schemas.masks); None: every token is the model's.
    mask: np.ndarray | None = None


@dataclass(frozen=True)
class FilteredStats:
    """Groups an actor sampled and did not send (zero-std and other filters), summed."""

    groups: int = 0
    zero_std_groups: int = 0
    completions: int = 0
    reward_sum: float = 0.0
    reward_std_sum: float = 0.0  # Σ over those groups of their reward std (0 for zero-std groups)

    def __add__(self, other: FilteredStats) -> FilteredStats:
        return FilteredStats(
            self.groups + other.groups,
            self.zero_std_groups + other.zero_std_groups,
            self.completions + other.completions,
            self.reward_sum + other.reward_sum,
            self.reward_std_sum + other.reward_std_sum,
        )

    def fields(self) -> dict[str, float]:
        """The summary as the fields of the ``filtered`` hash that counts it in Redis."""
        return {k: float(getattr(self, k)) for k in _FILTERED_FIELDS}

    @classmethod
    def from_fields(cls, h: dict[str, float]) -> FilteredStats:
        return cls(
            int(h.get("groups", 0)),
            int(h.get("zero_std_groups", 0)),
            int(h.get("completions", 0)),
            float(h.get("reward_sum", 0.0)),
            float(h.get("reward_std_sum", 0.0)),
        )

    def since(self, earlier: FilteredStats) -> FilteredStats:
        """What was added to these running totals after ``earlier`` (two reads of the hash), kept within what valid
        summaries allow despite float rounding; nothing when the totals went back (Redis lost its data)."""
        groups, completions = self.groups - earlier.groups, self.completions - earlier.completions
        if groups < 0 or completions < 0:
            return FilteredStats()
        return FilteredStats(
            groups,
            min(max(0, self.zero_std_groups - earlier.zero_std_groups), groups),
            completions,
            min(max(0.0, self.reward_sum - earlier.reward_sum), float(completions)),
            min(max(0.0, self.reward_std_sum - earlier.reward_std_sum), float(groups)),
        )


_FILTERED_FIELDS = ("groups", "zero_std_groups", "completions", "reward_sum", "reward_std_sum")


class Completions(Sequence[Completion]):
    """A group's completions held as columns, the way they travel: every completion's token ids end to end, its
    log-probs end to end, the offsets where each one starts, the rewards, the finish reasons, and where some token is
    the environment's, which tokens the model wrote (``mask``, end to end as well). Indexing gives a
    :class:`Completion` of views into the columns (no copies); code that handles whole groups (the learner's
    batch) reads the columns directly."""

    __slots__ = ("_offsets", "finish_reasons", "lengths", "logprobs", "mask", "rewards", "runs", "token_ids")

    def __init__(
        self,
        token_ids: np.ndarray,
        logprobs: np.ndarray,
        lengths: np.ndarray,
        rewards: np.ndarray,
        finish_reasons: tuple[FinishReason, ...],
        runs: VersionRuns | None = None,
        mask: np.ndarray | None = None,
    ):
        self.token_ids = token_ids  # int32 (N,), N = Σ lengths
        self.logprobs = logprobs  # float32 (N,)
        self.lengths = lengths  # int32 (G,)
        self.rewards = rewards  # float64 (G,)
        self.finish_reasons = finish_reasons
        self.runs = runs  # which version produced which tokens; None: all the group's policy_version's
        self.mask = mask  # uint8 (N,): 1 the model's token, 0 the environment's; None: every token the model's
        self._offsets: np.ndarray | None = None

    @property
    def offsets(self) -> np.ndarray:
        """int64 (G + 1,): completion i is ``token_ids[offsets[i]:offsets[i + 1]]`` (computed on first use)."""
        if self._offsets is None:
            self._offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
            np.cumsum(self.lengths, out=self._offsets[1:])
        return self._offsets

    @classmethod
    def of(cls, completions: Sequence[Completion], version: int | None = None) -> Completions:
        """Columns of ``completions``; ``version`` is their group's policy version (the version of the tokens of
        completions that carry no runs)."""
        if isinstance(completions, Completions):
            return completions
        lengths = np.array([len(c.token_ids) for c in completions], dtype=np.int32)
        return cls(
            _joined([c.token_ids for c in completions], INT32),
            _joined([c.logprobs for c in completions], FLOAT32),
            lengths,
            np.array([c.reward for c in completions], dtype=np.float64),
            tuple(c.finish_reason for c in completions),
            VersionRuns.of([c.runs for c in completions], lengths, version),
            joined_mask([c.mask for c in completions], lengths),
        )

    def __len__(self) -> int:
        return len(self.finish_reasons)

    @overload
    def __getitem__(self, i: int) -> Completion: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[Completion, ...]: ...
    def __getitem__(self, i: int | slice) -> Completion | tuple[Completion, ...]:
        if isinstance(i, slice):
            return tuple(self[k] for k in range(*i.indices(len(self))))
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"completion {i} of {n}")
        i %= n
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        runs = self.runs.completion(i) if self.runs is not None else None
        mask = self.mask[a:b] if self.mask is not None else None
        return Completion(
            self.token_ids[a:b], self.logprobs[a:b], float(self.rewards[i]), self.finish_reasons[i], runs, mask
        )


def _joined(arrays: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
