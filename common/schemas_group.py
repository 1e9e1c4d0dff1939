"""The group message (actor → Redis stream ``groups`` → learner): its types and its encoding. The layout and the
invariants are described in common.schemas, the wire module's front; decoding and validation are in
common.schemas_decode."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast, overload

import msgpack
import numpy as np

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: frozenset[str] = frozenset({"stop", "length", "abort"})

# The in-memory dtypes of token ids and log-probs, whatever they travelled as.
INT32, FLOAT32 = np.dtype(np.int32), np.dtype(np.float32)
# Below any log-prob a sampled token can have, with a wide margin: a sampler cannot draw a token whose probability its
# float format rounds to 0, and the smallest positive float32 is about e^-104 (bfloat16 e^-92, float64 e^-745).
LOGPROB_FLOOR = -1e4


@dataclass(frozen=True)
class Completion:
    token_ids: np.ndarray  # int32 (L,)
    logprobs: np.ndarray  # float32 (L,): behaviour log-probs of the sampled tokens, at the sampling temperature
    reward: float
    finish_reason: FinishReason


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
    log-probs end to end, the offsets where each one starts, the rewards and the finish reasons. Indexing gives a
    :class:`Completion` of views into the columns (no copies); code that handles whole groups (the learner's
    batch) reads the columns directly."""

    __slots__ = ("_offsets", "finish_reasons", "lengths", "logprobs", "rewards", "token_ids")

    def __init__(
        self,
        token_ids: np.ndarray,
        logprobs: np.ndarray,
        lengths: np.ndarray,
        rewards: np.ndarray,
        finish_reasons: tuple[FinishReason, ...],
    ):
        self.token_ids = token_ids  # int32 (N,), N = Σ lengths
        self.logprobs = logprobs  # float32 (N,)
        self.lengths = lengths  # int32 (G,)
        self.rewards = rewards  # float64 (G,)
        self.finish_reasons = finish_reasons
        self._offsets: np.ndarray | None = None

    @property
    def offsets(self) -> np.ndarray:
        """int64 (G + 1,): completion i is ``token_ids[offsets[i]:offsets[i + 1]]`` (computed on first use)."""
        if self._offsets is None:
            self._offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
            np.cumsum(self.lengths, out=self._offsets[1:])
        return self._offsets

    @classmethod
    def of(cls, completions: Sequence[Completion]) -> Completions:
        if isinstance(completions, Completions):
            return completions
        return cls(
            _joined([c.token_ids for c in completions], INT32),
            _joined([c.logprobs for c in completions], FLOAT32),
            np.array([len(c.token_ids) for c in completions], dtype=np.int32),
            np.array([c.reward for c in completions], dtype=np.float64),
            tuple(c.finish_reason for c in completions),
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
        return Completion(self.token_ids[a:b], self.logprobs[a:b], float(self.rewards[i]), self.finish_reasons[i])


def _joined(arrays: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


@dataclass(frozen=True)
class GroupMessage:
    prompt_id: str
    policy_version: int
    actor_id: str
    prompt_ids: np.ndarray  # int32 (P,)
    completions: Sequence[Completion]  # any sequence; held as Completions (see __post_init__)
    zero_std: bool = False
    filtered: FilteredStats = field(default_factory=FilteredStats)
    group_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_at: float = field(default_factory=time.time)
    # The lineage (learner epoch) of the weights it was sampled with, from their announcement; None when unknown
    # (a message of an older build, or an actor that never saw the announcement): the learner goes by the version.
    epoch: int | None = None

    def __post_init__(self) -> None:
        # Held as columns whatever was passed, so that encoding and the learner's batch work on whole arrays.
        object.__setattr__(self, "completions", Completions.of(self.completions))

    @property
    def columns(self) -> Completions:
        return cast(Completions, self.completions)

    @property
    def rewards(self) -> list[float]:
        return cast(list[float], self.columns.rewards.tolist())


# --- encoding -------------------------------------------------------------------------------------------------


_LITTLE_ENDIAN: dict[str, np.dtype] = {"int32": np.dtype("<i4"), "float32": np.dtype("<f4"), "float64": np.dtype("<f8")}


def _array(a: np.ndarray, dtype: str) -> dict[str, Any]:
    # tobytes() copies in C order whatever the layout; only another dtype needs a conversion first.
    a = np.asarray(a)
    return {
        "dtype": dtype,
        "data": (a if a.dtype == _LITTLE_ENDIAN[dtype] else a.astype(_LITTLE_ENDIAN[dtype])).tobytes(),
    }


def encode_group(msg: GroupMessage) -> bytes:
    """GroupMessage → msgpack bytes (the stream entry's ``data`` field), in the layout of :data:`SCHEMA_VERSION`."""
    c = msg.columns
    body = {
        "v": SCHEMA_VERSION,
        "type": "group",
        "group_id": msg.group_id,
        "prompt_id": msg.prompt_id,
        "policy_version": int(msg.policy_version),
        "actor_id": msg.actor_id,
        "created_at": float(msg.created_at),
        "prompt_ids": _array(msg.prompt_ids, "int32"),
        "completions": {
            "lengths": _array(c.lengths, "int32"),
            "token_ids": _array(c.token_ids, "int32"),
            "logprobs": _array(c.logprobs, "float32"),
            "rewards": _array(c.rewards, "float64"),
            "finish_reasons": list(c.finish_reasons),
        },
        "zero_std": bool(msg.zero_std),
        "filtered": {
            "groups": msg.filtered.groups,
            "zero_std_groups": msg.filtered.zero_std_groups,
            "completions": msg.filtered.completions,
            "reward_sum": float(msg.filtered.reward_sum),
            "reward_std_sum": float(msg.filtered.reward_std_sum),
        },
    }
    if msg.epoch is not None:  # optional: a message without it is what earlier builds send
        body["epoch"] = int(msg.epoch)
    return cast(bytes, msgpack.packb(body, use_bin_type=True))
