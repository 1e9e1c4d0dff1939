"""Decoding and validating a group message (msgpack bytes → :class:`~common.schemas_group.GroupMessage`): every
invariant the wire module's front (common.schemas) lists is checked here, and a failure is one SchemaError whose
text is the reason the dead-letter stream records."""

from __future__ import annotations

import math
from typing import Any, cast

import msgpack
import numpy as np

from common.schemas_fields import SchemaError
from common.schemas_fields import boolean as _bool
from common.schemas_fields import integer as _int
from common.schemas_fields import keys_of as _keys
from common.schemas_fields import number as _float
from common.schemas_fields import text as _str
from common.schemas_group import (
    FINISH_REASONS,
    FLOAT32,
    INT32,
    LOGPROB_FLOOR,
    READABLE_VERSIONS,
    Completion,
    Completions,
    FilteredStats,
    FinishReason,
    GroupMessage,
)

# The dtypes each array may travel as (all little-endian); the decoder converts to the in-memory dtype.
_ID_DTYPES: dict[str, np.dtype] = {"int32": np.dtype("<i4"), "int64": np.dtype("<i8")}
_FLOAT_DTYPES: dict[str, np.dtype] = {"float32": np.dtype("<f4"), "float64": np.dtype("<f8")}
_MAX_COMPLETIONS = 4096
_MAX_TOKENS = 1 << 20  # per completion in version 1; per group in version 2 it is _MAX_GROUP_TOKENS
# An engine may report log-probs a hair above 0 through rounding; anything above this is corrupt.
_LOGPROB_SLACK = 1e-3


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
    lengths = _decode_array(d["lengths"], "completions.lengths", _ID_DTYPES, INT32, _MAX_COMPLETIONS)
    rewards = _decode_array(d["rewards"], "completions.rewards", _FLOAT_DTYPES, np.dtype(np.float64), _MAX_COMPLETIONS)
    if len(lengths) != g or len(rewards) != g:
        raise SchemaError(f"completions: {g} finish reasons but {len(lengths)} lengths and {len(rewards)} rewards")
    # Every completion has at least one token; the group's total bounds each one from above.
    if _min(lengths) < 1:
        raise SchemaError("completions.lengths: every completion has at least one token")
    ids = _decode_array(d["token_ids"], "completions.token_ids", _ID_DTYPES, INT32, _MAX_GROUP_TOKENS)
    lps = _decode_array(d["logprobs"], "completions.logprobs", _FLOAT_DTYPES, FLOAT32, _MAX_GROUP_TOKENS)
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
        ids = _decode_array(d["token_ids"], f"{where}.token_ids", _ID_DTYPES, INT32)
        lps = _decode_array(d["logprobs"], f"{where}.logprobs", _FLOAT_DTYPES, FLOAT32)
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
    prompt_ids = _decode_array(d["prompt_ids"], "prompt_ids", _ID_DTYPES, INT32)
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
