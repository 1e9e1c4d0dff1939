"""Every message that crosses a process, in one place. msgpack only, never pickle.

Messages
--------
``GroupMessage`` (actor → Redis stream ``groups`` → learner)
    One prompt, its G completions with their behaviour log-probs and rewards, stamped with the policy version that
    generated them. Invariants, checked by :func:`decode_group`:

    - ``v`` is :data:`SCHEMA_VERSION` and ``type`` is ``"group"``; no unknown keys anywhere;
    - arrays travel as ``{"dtype": ..., "data": <little-endian bytes>}``, never as lists of numbers;
    - every completion has as many behaviour log-probs as tokens (at least one), log-probs are finite and ≤ 0;
    - rewards are finite and in [0, 1]; ``policy_version`` ≥ 0; ``finish_reason`` is stop | length | abort;
    - ``zero_std`` is true only when the actor forwarded an all-equal group because its resampling budget ran out;
    - ``filtered`` summarises the groups this actor filtered out since its previous message, so the learner can report
      the reward of everything sampled (TRL's ``reward`` is measured before any filtering).

``WeightsAnnouncement`` (learner → Redis hash ``weights:latest`` + channel ``weights`` → actors)
    ``version``, ``uri`` (a directory), ``sha256`` (over its ``*.safetensors`` files in name order), ``format``,
    ``published_at``.

A payload that fails here raises :class:`SchemaError` with a one-line reason; the learner moves it to the ``dead``
stream with that reason and the raw bytes.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import msgpack
import numpy as np

SCHEMA_VERSION = 1
FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: frozenset[str] = frozenset({"stop", "length", "abort"})

# The dtypes each array may travel as (all little-endian); the decoder converts to the in-memory dtype.
_ID_DTYPES: dict[str, np.dtype] = {"int32": np.dtype("<i4"), "int64": np.dtype("<i8")}
_FLOAT_DTYPES: dict[str, np.dtype] = {"float32": np.dtype("<f4"), "float64": np.dtype("<f8")}
_MAX_COMPLETIONS = 4096
_MAX_TOKENS = 1 << 20
_MAX_ID_LEN = 256
# An engine may report log-probs a hair above 0 through rounding; anything above this is corrupt.
_LOGPROB_SLACK = 1e-3


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


@dataclass(frozen=True)
class GroupMessage:
    prompt_id: str
    policy_version: int
    actor_id: str
    prompt_ids: np.ndarray  # int32 (P,)
    completions: tuple[Completion, ...]
    zero_std: bool = False
    filtered: FilteredStats = field(default_factory=FilteredStats)
    group_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_at: float = field(default_factory=time.time)

    @property
    def rewards(self) -> list[float]:
        return [c.reward for c in self.completions]


@dataclass(frozen=True)
class WeightsAnnouncement:
    version: int
    uri: str
    sha256: str
    format: str = "hf-safetensors"
    published_at: float = field(default_factory=time.time)

    def to_hash(self) -> dict[str, str]:
        return {
            "version": str(self.version),
            "uri": self.uri,
            "sha256": self.sha256,
            "format": self.format,
            "published_at": repr(self.published_at),
        }

    @classmethod
    def from_hash(cls, h: Mapping[Any, Any]) -> WeightsAnnouncement:
        d = {as_text(k): as_text(v) for k, v in h.items()}
        try:
            ann = cls(int(d["version"]), d["uri"], d["sha256"], d["format"], float(d["published_at"]))
        except (KeyError, ValueError) as e:
            raise SchemaError(f"weights announcement: missing or malformed field ({e})") from None
        if ann.version < 0 or len(ann.sha256) != 64:
            raise SchemaError(f"weights announcement: bad version {ann.version} or sha256 {ann.sha256!r}")
        return ann


def as_text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


# --- encoding -------------------------------------------------------------------------------------------------


_LITTLE_ENDIAN = {"int32": np.dtype("<i4"), "float32": np.dtype("<f4")}


def _array(a: np.ndarray, dtype: str) -> dict[str, Any]:
    return {"dtype": dtype, "data": np.ascontiguousarray(a, dtype=_LITTLE_ENDIAN[dtype]).tobytes()}


def encode_group(msg: GroupMessage) -> bytes:
    """GroupMessage → msgpack bytes (the stream entry's ``data`` field)."""
    body = {
        "v": SCHEMA_VERSION,
        "type": "group",
        "group_id": msg.group_id,
        "prompt_id": msg.prompt_id,
        "policy_version": int(msg.policy_version),
        "actor_id": msg.actor_id,
        "created_at": float(msg.created_at),
        "prompt_ids": _array(msg.prompt_ids, "int32"),
        "completions": [
            {
                "token_ids": _array(c.token_ids, "int32"),
                "logprobs": _array(c.logprobs, "float32"),
                "reward": float(c.reward),
                "finish_reason": c.finish_reason,
            }
            for c in msg.completions
        ],
        "zero_std": bool(msg.zero_std),
        "filtered": {
            "groups": msg.filtered.groups,
            "zero_std_groups": msg.filtered.zero_std_groups,
            "completions": msg.filtered.completions,
            "reward_sum": float(msg.filtered.reward_sum),
            "reward_std_sum": float(msg.filtered.reward_std_sum),
        },
    }
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


def _decode_array(v: Any, where: str, allowed: dict[str, np.dtype], out: np.dtype) -> np.ndarray:
    d = _keys(v, where, {"dtype", "data"})
    dtype = allowed.get(d["dtype"]) if isinstance(d["dtype"], str) else None
    if dtype is None:
        raise SchemaError(f"{where}: dtype {d['dtype']!r} not one of {sorted(allowed)}")
    data = d["data"]
    if not isinstance(data, bytes):
        raise SchemaError(f"{where}: data must be bytes, got {type(data).__name__}")
    if len(data) % dtype.itemsize:
        raise SchemaError(f"{where}: {len(data)} bytes is not a whole number of {d['dtype']}")
    n = len(data) // dtype.itemsize
    if not 1 <= n <= _MAX_TOKENS:
        raise SchemaError(f"{where}: {n} elements outside [1, {_MAX_TOKENS}]")
    # Values are range-checked by _check_values, once per group (per-array reductions cost more than decoding).
    # Ids are cast before that check only when they fit, so that an int64 id of 2^32 cannot wrap into range.
    arr = np.frombuffer(data, dtype=dtype)
    if arr.dtype.kind == "i" and arr.dtype.itemsize > 4 and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise SchemaError(f"{where}: token ids must be in [0, 2^31)")
    return arr.astype(out)


def _ids_ok(a: np.ndarray) -> bool:
    return bool(a.min() >= 0)


def _logprobs_ok(a: np.ndarray) -> bool:
    return bool(np.isfinite(a).all() and a.max() <= _LOGPROB_SLACK)


def _check_values(prompt_ids: np.ndarray, completions: Sequence[Completion]) -> None:
    """Token ids in [0, 2^31) and log-probs finite and <= 0, checked over the whole group at once; only when that
    fails are the arrays looked at one by one, to name the bad one."""
    if _ids_ok(np.concatenate([prompt_ids, *(c.token_ids for c in completions)])) and _logprobs_ok(
        np.concatenate([c.logprobs for c in completions])
    ):
        return
    if not _ids_ok(prompt_ids):
        raise SchemaError("prompt_ids: token ids must be in [0, 2^31)")
    for i, c in enumerate(completions):
        if not _ids_ok(c.token_ids):
            raise SchemaError(f"completions[{i}].token_ids: token ids must be in [0, 2^31)")
        if not _logprobs_ok(c.logprobs):
            raise SchemaError(f"completions[{i}].logprobs: must be finite and <= 0")


_INT32, _FLOAT32 = np.dtype(np.int32), np.dtype(np.float32)
_COMPLETION_KEYS = {"token_ids", "logprobs", "reward", "finish_reason"}
_ARRAY_KEYS = {"dtype", "data"}


def _decode_completion(v: Any, i: int) -> Completion:
    # Hot path (a batch decodes thousands of these): the error's location string is built only on failure.
    if type(v) is dict and v.keys() == _COMPLETION_KEYS:
        t, lp = v["token_ids"], v["logprobs"]
        if (
            type(t) is dict
            and type(lp) is dict
            and t.keys() == _ARRAY_KEYS
            and lp.keys() == _ARRAY_KEYS
            and t["dtype"] == "int32"
            and lp["dtype"] == "float32"
            and type(t["data"]) is bytes
            and type(lp["data"]) is bytes
            and len(t["data"]) == len(lp["data"])
            and 0 < len(t["data"]) <= 4 * _MAX_TOKENS
            and len(t["data"]) % 4 == 0
            and type(v["finish_reason"]) is str
            and v["finish_reason"] in FINISH_REASONS
            and type(v["reward"]) is float
            and 0.0 <= v["reward"] <= 1.0
        ):
            # Read-only views of the message's bytes, no copies: a decoded message is immutable, and the learner
            # copies what it trains on into tensors anyway.
            return Completion(
                np.frombuffer(t["data"], dtype=_LITTLE_ENDIAN["int32"]),
                np.frombuffer(lp["data"], dtype=_LITTLE_ENDIAN["float32"]),
                v["reward"],
                cast(FinishReason, v["finish_reason"]),
            )
    return _decode_completion_checked(v, f"completions[{i}]")


def _decode_completion_checked(v: Any, where: str) -> Completion:
    """Every check with its message: other dtypes, wrong types, and everything malformed."""
    d = _keys(v, where, _COMPLETION_KEYS)
    ids = _decode_array(d["token_ids"], f"{where}.token_ids", _ID_DTYPES, _INT32)
    lps = _decode_array(d["logprobs"], f"{where}.logprobs", _FLOAT_DTYPES, _FLOAT32)
    if len(ids) != len(lps):
        raise SchemaError(f"{where}: {len(ids)} tokens but {len(lps)} log-probs")
    reason = d["finish_reason"]
    if not isinstance(reason, str) or reason not in FINISH_REASONS:
        raise SchemaError(f"{where}.finish_reason: {reason!r} not one of {sorted(FINISH_REASONS)}")
    reward = _float(d["reward"], f"{where}.reward", 0.0, 1.0)
    return Completion(ids, lps, reward, cast(FinishReason, reason))


def _decode_filtered(v: Any) -> FilteredStats:
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


def decode_group(raw: bytes) -> GroupMessage:
    """msgpack bytes → validated GroupMessage, or :class:`SchemaError` with the reason."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise SchemaError(f"payload must be bytes, got {type(raw).__name__}")
    try:
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, msgpack.UnpackException, UnicodeDecodeError, TypeError, RecursionError) as e:
        raise SchemaError(f"not msgpack: {type(e).__name__}: {str(e)[:120]}") from None
    if isinstance(body, dict) and "v" in body and body.get("v") != SCHEMA_VERSION:
        raise SchemaError(f"unsupported schema version {body.get('v')!r} (this build reads {SCHEMA_VERSION})")
    d = _keys(body, "group", _GROUP_KEYS)
    if d["type"] != "group":
        raise SchemaError(f"type: expected 'group', got {d['type']!r}")
    comps = d["completions"]
    if not isinstance(comps, list) or not 1 <= len(comps) <= _MAX_COMPLETIONS:
        raise SchemaError(f"completions: expected a list of 1..{_MAX_COMPLETIONS} completions")
    prompt_ids = _decode_array(d["prompt_ids"], "prompt_ids", _ID_DTYPES, _INT32)
    completions = tuple(_decode_completion(c, i) for i, c in enumerate(comps))
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
    )
