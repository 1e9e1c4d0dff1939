"""Every message that crosses a process, in one place. msgpack only, never pickle.

Messages
--------
``GroupMessage`` (actor → Redis stream ``groups`` → learner)
    One prompt, its G completions with their behaviour log-probs and rewards, stamped with the policy version that
    generated them. Invariants, checked by :func:`decode_group`:

    - ``v`` is :data:`SCHEMA_VERSION` (or 1, read for groups still in a stream written by an older build) and
      ``type`` is ``"group"``; no unknown keys anywhere;
    - arrays travel as ``{"dtype": ..., "data": <little-endian bytes>}``, never as lists of numbers;
    - every completion has as many behaviour log-probs as tokens (at least one), log-probs are in
      [:data:`LOGPROB_FLOOR` = −1e4, 0]: a sampled token's log-prob is ≤ 0, and no sampler can draw a token whose
      probability its float format rounds to 0 (below e^-104 in float32, e^-745 in float64), so anything lower is
      corrupt (−1e30 made every update of a step non-finite);
    - rewards are finite and in [0, 1]; ``policy_version`` ≥ 0; ``finish_reason`` is stop | length | abort;
    - ``zero_std`` is true only when the actor forwarded an all-equal group because its resampling budget ran out;
    - ``filtered`` summarises groups an actor filtered out, so the learner can report the reward of everything sampled
      (TRL's ``reward`` is measured before any filtering). Actors of this build send it empty and count what they
      filter in Redis, in the script that writes the round (the ``filtered`` hash, common.transport), where a dropped
      group cannot take it along; the learner still adds what an older actor's message carries;
    - ``epoch`` (optional, an int ≥ 0): the learner lineage of the weights it was sampled with, from their
      announcement; messages without it (earlier builds) are read by their version alone.

Layout (version 2). The G completions travel as columns, not as G maps: ``completions`` is one map of
``lengths`` (int32, G), ``token_ids`` and ``logprobs`` (every completion's, end to end, ``sum(lengths)`` each),
``rewards`` (float64, G) and ``finish_reasons`` (G strings)::

    {"v": 2, "type": "group", "group_id": str, "prompt_id": str, "policy_version": int, "actor_id": str,
     "created_at": float, "prompt_ids": array, "zero_std": bool, "filtered": {...},
     "completions": {"lengths": array, "token_ids": array, "logprobs": array, "rewards": array,
                     "finish_reasons": [str, ...]}}

Why columns: a group is a handful of arrays whatever G is, so packing, unpacking and checking it costs a few numpy
calls instead of G small maps of nested maps; that halved the cost of moving a group through Redis (benchmark
B3). Version 1 carried ``completions`` as a list of ``{"token_ids", "logprobs", "reward", "finish_reason"}`` maps;
the decoder still reads it, so groups left in a stream by an older build are trained, not dead-lettered.

``WeightsAnnouncement`` (learner → Redis hash ``weights:latest`` + channel ``weights`` → actors)
    ``version``, ``uri`` (a directory), ``digest`` (``xxh3-128:<hex>`` or ``sha256:<hex>``, over its
    ``*.safetensors`` files in name order; an announcement with only the ``sha256`` field of earlier builds is
    read as ``sha256:<it>``), ``format``, ``published_at``, ``epoch`` (the learner lineage; 0 when absent).

A payload that fails here raises :class:`SchemaError` with a one-line reason; the learner moves it to the ``dead``
stream with that reason and the raw bytes.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast, overload

import msgpack
import numpy as np

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: frozenset[str] = frozenset({"stop", "length", "abort"})

# The dtypes each array may travel as (all little-endian); the decoder converts to the in-memory dtype.
_ID_DTYPES: dict[str, np.dtype] = {"int32": np.dtype("<i4"), "int64": np.dtype("<i8")}
_FLOAT_DTYPES: dict[str, np.dtype] = {"float32": np.dtype("<f4"), "float64": np.dtype("<f8")}
_INT32, _FLOAT32 = np.dtype(np.int32), np.dtype(np.float32)
_MAX_COMPLETIONS = 4096
_MAX_TOKENS = 1 << 20  # per completion in version 1; per group in version 2 it is _MAX_GROUP_TOKENS
_MAX_ID_LEN = 256
# An engine may report log-probs a hair above 0 through rounding; anything above this is corrupt.
_LOGPROB_SLACK = 1e-3
# Below any log-prob a sampled token can have, with a wide margin: a sampler cannot draw a token whose probability its
# float format rounds to 0, and the smallest positive float32 is about e^-104 (bfloat16 e^-92, float64 e^-745).
LOGPROB_FLOOR = -1e4


class SchemaError(ValueError):
    """A message that does not decode or validate. ``str(err)`` is the reason recorded in the dead-letter stream."""


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
            _joined([c.token_ids for c in completions], _INT32),
            _joined([c.logprobs for c in completions], _FLOAT32),
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


# The digests a version may be announced with, and the length of each one's hex form.
DIGEST_HEX_LENGTHS = {"xxh3-128": 32, "sha256": 64}
# How an announced version is delivered: a directory of safetensors files, or over the NCCL update group.
WEIGHTS_FORMATS = ("hf-safetensors", "nccl")


@dataclass(frozen=True)
class WeightsAnnouncement:
    version: int
    uri: str
    digest: str  # "<algorithm>:<hex>", e.g. "xxh3-128:9f…" (see common.weights.digest)
    format: str = "hf-safetensors"
    published_at: float = field(default_factory=time.time)
    epoch: int = 0  # the learner lineage that published it (see learner.lineage); 0 in an older build's hash

    @property
    def digest_algorithm(self) -> str:
        return self.digest.partition(":")[0]

    def to_hash(self) -> dict[str, str]:
        return {
            "version": str(self.version),
            "uri": self.uri,
            "digest": self.digest,
            "format": self.format,
            "published_at": repr(self.published_at),
            "epoch": str(self.epoch),
        }

    @classmethod
    def from_hash(cls, h: Mapping[Any, Any]) -> WeightsAnnouncement:
        """The hash ``weights:latest`` → a validated announcement, or :class:`SchemaError` with a one-line reason
        (anyone with write access to Redis, or a newer build, may have written it: it is input, not a promise)."""
        try:
            d = {as_text(k): as_text(v) for k, v in h.items()}
        except UnicodeDecodeError:
            raise SchemaError("weights announcement: a field that is not UTF-8 text") from None
        if "digest" not in d and "sha256" in d:  # announced by a build before the digest field (sha256 only)
            d["digest"] = f"sha256:{d['sha256']}"
        if missing := sorted({"version", "uri", "digest", "format", "published_at"} - d.keys()):
            raise SchemaError(f"weights announcement: missing {', '.join(missing)}")
        try:
            ann = cls(
                int(d["version"]), d["uri"], d["digest"], d["format"], float(d["published_at"]), int(d.get("epoch", 0))
            )
        except ValueError as e:
            raise SchemaError(f"weights announcement: malformed field ({str(e)[:120]})") from None
        ann._check()
        return ann

    def _check(self) -> None:
        if not 0 <= self.version <= 1 << 53:
            raise SchemaError(f"weights announcement: version {self.version} outside [0, 2^53]")
        algorithm, _, hexdigest = self.digest.partition(":")
        if len(hexdigest) != DIGEST_HEX_LENGTHS.get(algorithm) or not all(c in "0123456789abcdef" for c in hexdigest):
            raise SchemaError(
                f"weights announcement: digest {self.digest[:80]!r} is not <algorithm>:<hex> with an algorithm of "
                f"{sorted(DIGEST_HEX_LENGTHS)}"
            )
        if self.format not in WEIGHTS_FORMATS:
            raise SchemaError(
                f"weights announcement: format {self.format[:40]!r} unknown to this build (it reads "
                f"{', '.join(WEIGHTS_FORMATS)}: upgrade the actors with the learner)"
            )
        if not 0 < len(self.uri) <= 4096 or "\x00" in self.uri:
            raise SchemaError(f"weights announcement: uri of {len(self.uri)} characters")


def as_text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


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


# --- decoding and validation ----------------------------------------------------------------------------------


def _keys(d: Any, where: str, required: set[str]) -> dict[str, Any]:
    if type(d) is dict and d.keys() == required:  # the common case, without building sets
        return d
    if not isinstance(d, dict):
        raise SchemaError(f"{where}: expected a map, got {type(d).__name__}")
    keys = set(d)
    if missing := required - keys:
        raise SchemaError(f"{where}: missing {sorted(missing)}")
    if extra := keys - required:
        raise SchemaError(f"{where}: unknown keys {sorted(map(str, extra))}")
    return d


def _int(v: Any, where: str, lo: int = 0, hi: int = 1 << 53) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise SchemaError(f"{where}: expected an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise SchemaError(f"{where}: {v} outside [{lo}, {hi}]")
    return v


def _float(v: Any, where: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SchemaError(f"{where}: expected a number, got {type(v).__name__}")
    f = float(v)
    if not math.isfinite(f) or not lo <= f <= hi:
        raise SchemaError(f"{where}: {f} is not finite in [{lo}, {hi}]")
    return f


def _str(v: Any, where: str, allow_empty: bool = False) -> str:
    if not isinstance(v, str):
        raise SchemaError(f"{where}: expected a string, got {type(v).__name__}")
    if (not v and not allow_empty) or len(v) > _MAX_ID_LEN:
        raise SchemaError(f"{where}: length {len(v)} outside [1, {_MAX_ID_LEN}]")
    return v


def _bool(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise SchemaError(f"{where}: expected a boolean, got {type(v).__name__}")
    return v


def _decode_array(
    v: Any, where: str, allowed: dict[str, np.dtype], out: np.dtype, most: int = _MAX_TOKENS
) -> np.ndarray:
    """A read-only array viewing the message's bytes (converted, so copied, only when it travelled as another
    dtype than ``out``): a decoded message is immutable, and the learner copies what it trains on anyway."""
    if type(v) is dict and v.keys() == _ARRAY_KEYS and type(data := v["data"]) is bytes:
        dt = allowed.get(v["dtype"]) if type(v["dtype"]) is str else None
        if dt is not None and dt == out and 0 < len(data) <= most * dt.itemsize and len(data) % dt.itemsize == 0:
            return np.frombuffer(data, dtype=dt)  # the common case: already the in-memory dtype
    d = _keys(v, where, _ARRAY_KEYS)
    dtype = allowed.get(d["dtype"]) if isinstance(d["dtype"], str) else None
    if dtype is None:
        raise SchemaError(f"{where}: dtype {d['dtype']!r} not one of {sorted(allowed)}")
    data = d["data"]
    if not isinstance(data, bytes):
        raise SchemaError(f"{where}: data must be bytes, got {type(data).__name__}")
    if len(data) % dtype.itemsize:
        raise SchemaError(f"{where}: {len(data)} bytes is not a whole number of {d['dtype']}")
    n = len(data) // dtype.itemsize
    if not 1 <= n <= most:
        raise SchemaError(f"{where}: {n} elements outside [1, {most}]")
    # Values are range-checked by _check_values, once per group (per-array reductions cost more than decoding).
    # Ids are cast before that check only when they fit, so that an int64 id of 2^32 cannot wrap into range.
    arr = np.frombuffer(data, dtype=dtype)
    if arr.dtype.kind == "i" and arr.dtype.itemsize > 4 and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise SchemaError(f"{where}: values must be in [0, 2^31)")
    return arr.astype(out, copy=False)


_min, _max, _add = (
    np.minimum.reduce,
    np.maximum.reduce,
    np.add.reduce,
)  # the ufuncs themselves: a third of ndarray.min's overhead


def _check_values(prompt_ids: np.ndarray, c: Completions) -> None:
    """Token ids in [0, 2^31), log-probs in [LOGPROB_FLOOR, 0], rewards finite in [0, 1]: two reductions per column over
    the whole group (NaN fails every comparison, infinities fail the bounds); only when one fails is the first bad
    value looked for, to name its completion."""
    if _min(prompt_ids) < 0:
        raise SchemaError("prompt_ids: token ids must be in [0, 2^31)")
    if _min(c.token_ids) < 0:
        i = _owner(c, np.flatnonzero(c.token_ids < 0))
        raise SchemaError(f"completions[{i}].token_ids: token ids must be in [0, 2^31)")
    lp = c.logprobs
    if not (_min(lp) >= LOGPROB_FLOOR and _max(lp) <= _LOGPROB_SLACK):
        bad = np.flatnonzero(~((lp >= LOGPROB_FLOOR) & (lp <= _LOGPROB_SLACK)))
        value = float(lp[bad[0]])
        raise SchemaError(
            f"completions[{_owner(c, bad)}].logprobs: must be finite and <= 0, and >= {LOGPROB_FLOOR:g} (no sampler "
            f"draws a token that unlikely); got {value}"
        )
    # G numbers: Python's min and max beat two numpy calls. They can step over a NaN (every comparison with it is
    # false), so the sum, which a NaN always reaches, is checked too.
    rewards = c.rewards.tolist()
    if not (min(rewards) >= 0.0 and max(rewards) <= 1.0 and math.isfinite(sum(rewards))):
        i, bad = next((i, r) for i, r in enumerate(rewards) if not 0.0 <= r <= 1.0)  # NaN fails both
        raise SchemaError(f"completions[{i}].reward: {bad} is not finite in [0.0, 1.0]")


def _owner(c: Completions, positions: np.ndarray) -> int:
    """The completion that holds the first of these token positions."""
    return int(np.searchsorted(c.offsets, positions[0], side="right")) - 1


_ARRAY_KEYS = {"dtype", "data"}
_COLUMN_KEYS = {"lengths", "token_ids", "logprobs", "rewards", "finish_reasons"}
_MAX_GROUP_TOKENS = 1 << 24


def _finish_reasons(v: Any) -> tuple[FinishReason, ...]:
    if type(v) is not list or not 1 <= len(v) <= _MAX_COMPLETIONS:
        raise SchemaError(f"completions.finish_reasons: expected a list of 1..{_MAX_COMPLETIONS} strings")
    try:
        ok = FINISH_REASONS.issuperset(v)
    except TypeError:  # an unhashable element
        ok = False
    if not ok:
        i, bad = next((i, r) for i, r in enumerate(v) if not isinstance(r, str) or r not in FINISH_REASONS)
        raise SchemaError(f"completions[{i}].finish_reason: {bad!r} not one of {sorted(FINISH_REASONS)}")
    return tuple(v)


def _decode_columns(v: Any) -> Completions:
    """Version 2: the completions as columns (see the module's docstring)."""
    d = _keys(v, "completions", _COLUMN_KEYS)
    reasons = _finish_reasons(d["finish_reasons"])
    g = len(reasons)
    lengths = _decode_array(d["lengths"], "completions.lengths", _ID_DTYPES, _INT32, _MAX_COMPLETIONS)
    rewards = _decode_array(d["rewards"], "completions.rewards", _FLOAT_DTYPES, np.dtype(np.float64), _MAX_COMPLETIONS)
    if len(lengths) != g or len(rewards) != g:
        raise SchemaError(f"completions: {g} finish reasons but {len(lengths)} lengths and {len(rewards)} rewards")
    # Every completion has at least one token; the group's total bounds each one from above.
    if _min(lengths) < 1:
        raise SchemaError("completions.lengths: every completion has at least one token")
    ids = _decode_array(d["token_ids"], "completions.token_ids", _ID_DTYPES, _INT32, _MAX_GROUP_TOKENS)
    lps = _decode_array(d["logprobs"], "completions.logprobs", _FLOAT_DTYPES, _FLOAT32, _MAX_GROUP_TOKENS)
    if len(ids) != (total := int(_add(lengths, dtype=np.int64))):
        raise SchemaError(f"completions: lengths add up to {total} tokens but token_ids has {len(ids)}")
    if len(lps) != len(ids):
        raise SchemaError(f"completions: {len(ids)} tokens but {len(lps)} log-probs")
    return Completions(ids, lps, lengths, rewards, reasons)


_V1_COMPLETION_KEYS = {"token_ids", "logprobs", "reward", "finish_reason"}


def _decode_v1_completions(v: Any) -> Completions:
    """Version 1: a list of one map per completion."""
    if not isinstance(v, list) or not 1 <= len(v) <= _MAX_COMPLETIONS:
        raise SchemaError(f"completions: expected a list of 1..{_MAX_COMPLETIONS} completions")
    out = []
    for i, c in enumerate(v):
        where = f"completions[{i}]"
        d = _keys(c, where, _V1_COMPLETION_KEYS)
        ids = _decode_array(d["token_ids"], f"{where}.token_ids", _ID_DTYPES, _INT32)
        lps = _decode_array(d["logprobs"], f"{where}.logprobs", _FLOAT_DTYPES, _FLOAT32)
        if len(ids) != len(lps):
            raise SchemaError(f"{where}: {len(ids)} tokens but {len(lps)} log-probs")
        reason = d["finish_reason"]
        if not isinstance(reason, str) or reason not in FINISH_REASONS:
            raise SchemaError(f"{where}.finish_reason: {reason!r} not one of {sorted(FINISH_REASONS)}")
        out.append(Completion(ids, lps, _float(d["reward"], f"{where}.reward", 0.0, 1.0), cast(FinishReason, reason)))
    return Completions.of(out)


_NO_FILTERED = FilteredStats()
_NOTHING_FILTERED = {"groups": 0, "zero_std_groups": 0, "completions": 0, "reward_sum": 0.0, "reward_std_sum": 0.0}


def _decode_filtered(v: Any) -> FilteredStats:
    if v == _NOTHING_FILTERED and all(type(v[k]) is type(x) for k, x in _NOTHING_FILTERED.items()):
        return _NO_FILTERED  # the usual case: the actor filtered nothing since its previous message
    d = _keys(v, "filtered", {"groups", "zero_std_groups", "completions", "reward_sum", "reward_std_sum"})
    groups = _int(d["groups"], "filtered.groups")
    stats = FilteredStats(
        groups=groups,
        zero_std_groups=_int(d["zero_std_groups"], "filtered.zero_std_groups", 0, groups),
        completions=_int(d["completions"], "filtered.completions"),
        reward_sum=_float(d["reward_sum"], "filtered.reward_sum", 0.0),
        reward_std_sum=_float(d["reward_std_sum"], "filtered.reward_std_sum", 0.0),
    )
    if stats.reward_sum > stats.completions + 1e-6 or stats.reward_std_sum > stats.groups + 1e-6:
        raise SchemaError("filtered: reward sums exceed what rewards in [0, 1] allow")
    return stats


_GROUP_KEYS = {
    "v",
    "type",
    "group_id",
    "prompt_id",
    "policy_version",
    "actor_id",
    "created_at",
    "prompt_ids",
    "completions",
    "zero_std",
    "filtered",
}
_GROUP_KEYS_WITH_EPOCH = _GROUP_KEYS | {"epoch"}


def decode_group(raw: bytes) -> GroupMessage:
    """msgpack bytes → validated GroupMessage, or :class:`SchemaError` with the reason."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise SchemaError(f"payload must be bytes, got {type(raw).__name__}")
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, msgpack.UnpackException, UnicodeDecodeError, TypeError, RecursionError) as e:
        raise SchemaError(f"not msgpack: {type(e).__name__}: {str(e)[:120]}") from None
    version = body.get("v") if isinstance(body, dict) else None
    if isinstance(body, dict) and "v" in body and (type(version) is not int or version not in READABLE_VERSIONS):
        raise SchemaError(
            f"unsupported schema version {version!r} (this build reads {', '.join(map(str, READABLE_VERSIONS))})"
        )
    d = _keys(body, "group", _GROUP_KEYS_WITH_EPOCH if isinstance(body, dict) and "epoch" in body else _GROUP_KEYS)
    if d["type"] != "group":
        raise SchemaError(f"type: expected 'group', got {d['type']!r}")
    completions = _decode_columns(d["completions"]) if version == 2 else _decode_v1_completions(d["completions"])
    prompt_ids = _decode_array(d["prompt_ids"], "prompt_ids", _ID_DTYPES, _INT32)
    _check_values(prompt_ids, completions)
    return GroupMessage(
        group_id=_str(d["group_id"], "group_id"),
        prompt_id=_str(d["prompt_id"], "prompt_id"),
        policy_version=_int(d["policy_version"], "policy_version"),
        actor_id=_str(d["actor_id"], "actor_id"),
        created_at=_float(d["created_at"], "created_at", 0.0),
        prompt_ids=prompt_ids,
        completions=completions,
        zero_std=_bool(d["zero_std"], "zero_std"),
        filtered=_decode_filtered(d["filtered"]),
        epoch=_int(d["epoch"], "epoch") if "epoch" in d else None,
    )
