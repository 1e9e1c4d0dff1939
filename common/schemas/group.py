"""The group message (actor → Redis stream ``groups`` → learner): its types, its encoding, and its decoding with every
invariant the wire package's face (common.schemas) lists checked; a failure is one SchemaError whose text is the
reason the dead-letter stream records."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, cast

import msgpack
import numpy as np

from common.schemas.completions import (
    FINISH_REASONS,
    FLOAT32,
    INT32,
    Completion,
    Completions,
    FinishReason,
)
from common.schemas.fields import SchemaError
from common.schemas.fields import boolean as _bool
from common.schemas.fields import integer as _int
from common.schemas.fields import keys_of as _keys
from common.schemas.fields import number as _float
from common.schemas.fields import text as _str
from common.schemas.masks import MASK_KEYS, checked_logprobs, mask_from_runs, mask_runs
from common.schemas.versions import VERSION_KEYS, VersionRuns, check_runs, runs_from_fields

SCHEMA_VERSION = 6
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)
# Below any log-prob a sampled token can have, with a wide margin: a sampler cannot draw a token whose probability its
# float format rounds to 0, and the smallest positive float32 is about e^-104 (bfloat16 e^-92, float64 e^-745).
LOGPROB_FLOOR = -1e4


@dataclass(frozen=True)
class GroupMessage:
    prompt_id: str
    policy_version: int
    actor_id: str
    prompt_ids: np.ndarray  # int32 (P,)
    completions: Sequence[Completion]  # any sequence; held as Completions (see __post_init__)
    zero_std: bool = False
    # DAPO's overlong penalty of each completion (float32 (G,), each in [-overlong_factor, 0]), computed once by the
    # actor that shaped its rewards with it (its filter decided on rewards + penalties, and the learner's advantages
    # use the same numbers); None: no shaping (or an older build's message).
    penalties: np.ndarray | None = None
    group_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created_at: float = field(default_factory=time.time)
    # The lineage (learner epoch) of the weights it was sampled with, from their announcement; None when unknown
    # (a message of an older build, or an actor that never saw the announcement): the learner goes by the version.
    epoch: int | None = None
    # The prompt cursor's position it was drawn at (common.schemas.prompts): the learner marks it trained when it
    # acknowledges the group; None for a message of an older build.
    position: int | None = None

    def __post_init__(self) -> None:
        # Held as columns whatever was passed, so that encoding and the learner's batch work on whole arrays.
        object.__setattr__(self, "completions", Completions.of(self.completions, self.policy_version))

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
    columns: dict[str, Any] = {
        "lengths": _array(c.lengths, "int32"),
        "token_ids": _array(c.token_ids, "int32"),
        "logprobs": _array(c.logprobs, "float32"),
        "rewards": _array(c.rewards, "float64"),
        "finish_reasons": list(c.finish_reasons),
    }
    if c.runs is not None:  # optional: only answers whose tokens came from more than one version carry it
        columns["versions"] = {k: _array(a, "int32") for k, a in c.runs.fields().items()}
    if c.mask is not None and not c.mask.all():  # optional: only episodes with some tool output carry it
        columns["mask"] = {k: _array(a, "int32") for k, a in mask_runs(c.mask, c.offsets).items()}
    body = {
        "v": SCHEMA_VERSION,
        "type": "group",
        "group_id": msg.group_id,
        "prompt_id": msg.prompt_id,
        "policy_version": int(msg.policy_version),
        "actor_id": msg.actor_id,
        "created_at": float(msg.created_at),
        "prompt_ids": _array(msg.prompt_ids, "int32"),
        "completions": columns,
        "zero_std": bool(msg.zero_std),
    }
    if msg.penalties is not None:  # optional: only an actor that shaped its rewards sends them
        body["penalties"] = _array(msg.penalties, "float32")
    if msg.epoch is not None:  # optional: a message without it is what earlier builds send
        body["epoch"] = int(msg.epoch)
    if msg.position is not None:  # optional: a group replayed or written by hand may have none
        body["position"] = int(msg.position)
    return cast(bytes, msgpack.packb(body, use_bin_type=True))


# -- decoding --------------------------------------------------------------------------------------------------------

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
    """Token ids in [0, 2^31), log-probs in [LOGPROB_FLOOR, 0] (or NaN on environment tokens), rewards finite in
    [0, 1]: two reductions per column over the whole group (NaN fails every comparison, infinities fail the bounds);
    only when one fails is the first bad value looked for, to name its completion."""
    if _min(prompt_ids) < 0:
        raise SchemaError("prompt_ids: token ids must be in [0, 2^31)")
    if _min(c.token_ids) < 0:
        i = _owner(c, np.flatnonzero(c.token_ids < 0))
        raise SchemaError(f"completions[{i}].token_ids: token ids must be in [0, 2^31)")
    lp = checked_logprobs(c.logprobs, c.mask)  # an environment token's NaN passes; a model token's does not
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
_COLUMN_EXTRAS = {"versions": 4, "mask": 5}  # optional columns, and the version each came in
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


def _decode_columns(v: Any, version: int) -> Completions:
    """Versions 2 to 5: the completions as columns (see the module's docstring), since 4 with optional ``versions``
    and since 5 with optional ``mask``."""
    extra = {k for k, since in _COLUMN_EXTRAS.items() if version >= since and type(v) is dict and k in v}
    d = _keys(v, "completions", _COLUMN_KEYS | extra)
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
    runs = _decode_runs(d["versions"]) if "versions" in d else None
    mask = _decode_mask(d["mask"], lengths) if "mask" in d else None
    return Completions(ids, lps, lengths, rewards, reasons, runs, mask)


def _decode_runs(v: Any) -> VersionRuns:
    d = _keys(v, "completions.versions", VERSION_KEYS)
    # Checked against the lengths and the policy version by decode_group, once both are read.
    return runs_from_fields(d, lambda a, where: _decode_array(a, where, _ID_DTYPES, INT32, _MAX_GROUP_TOKENS))


def _decode_mask(v: Any, lengths: np.ndarray) -> np.ndarray | None:
    d = _keys(v, "completions.mask", MASK_KEYS)
    return mask_from_runs(d, lambda a, where: _decode_array(a, where, _ID_DTYPES, INT32, _MAX_GROUP_TOKENS), lengths)


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


_MAX_PENALTY = 1e6  # a penalty's size is overlong_factor's; anything larger is corrupt


def _decode_penalties(v: Any, g: int) -> np.ndarray:
    p = _decode_array(v, "penalties", _FLOAT_DTYPES, FLOAT32, _MAX_COMPLETIONS)
    if len(p) != g:
        raise SchemaError(f"penalties: {len(p)} for {g} completions")
    if len(p) and not (_min(p) >= -_MAX_PENALTY and _max(p) <= 0.0):  # a NaN fails both
        raise SchemaError(f"penalties: each is finite in [-{_MAX_PENALTY:g}, 0]")
    return p


# The keys of each version beside the optional ``epoch``: versions 1 and 2 carried ``filtered`` (a summary of the
# groups an actor filtered out, which this build reads from Redis alone: its value is skipped), versions 3 to 6
# carry optional ``penalties`` instead (4 optional ``versions`` inside ``completions``, 5 ``mask`` too, and 6 an
# optional ``position``).
_BASE_KEYS = {"v", "type", "group_id", "prompt_id", "policy_version", "actor_id", "created_at", "prompt_ids",
              "completions", "zero_std"}  # fmt: skip
_OPTIONAL_KEYS = {
    v: {"epoch"} | ({"penalties"} if v >= 3 else set()) | ({"position"} if v >= 6 else set()) for v in READABLE_VERSIONS
}
_REQUIRED_KEYS = {v: _BASE_KEYS | ({"filtered"} if v < 3 else set()) for v in READABLE_VERSIONS}


# Every set of keys a valid message of each version has, to match a message's keys at once (the common case).
_KEY_SETS = {
    v: [_REQUIRED_KEYS[v] | set(extra) for k in range(len(opt) + 1) for extra in combinations(sorted(opt), k)]
    for v, opt in _OPTIONAL_KEYS.items()
}


def _group_keys(body: Any, version: Any) -> dict[str, Any]:
    """The message's fields, exactly its version's (a message without ``v`` fails: ``v`` is required)."""
    if type(body) is dict and any(body.keys() == ks for ks in _KEY_SETS.get(version, ())):
        return body
    required = _REQUIRED_KEYS.get(version, _BASE_KEYS)
    present = body.keys() & _OPTIONAL_KEYS.get(version, set()) if isinstance(body, dict) else set()
    return _keys(body, "group", required | present)


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
    d = _group_keys(body, version)
    if d["type"] != "group":
        raise SchemaError(f"type: expected 'group', got {d['type']!r}")
    cols = d["completions"]
    completions = _decode_columns(cols, cast(int, version)) if version != 1 else _decode_v1_completions(cols)
    prompt_ids = _decode_array(d["prompt_ids"], "prompt_ids", _ID_DTYPES, INT32)
    _check_values(prompt_ids, completions)
    policy_version = _int(d["policy_version"], "policy_version")
    if completions.runs is not None:
        check_runs(completions.runs, completions.lengths, policy_version)
    return GroupMessage(
        group_id=_str(d["group_id"], "group_id"),
        prompt_id=_str(d["prompt_id"], "prompt_id"),
        policy_version=policy_version,
        actor_id=_str(d["actor_id"], "actor_id"),
        created_at=_float(d["created_at"], "created_at", 0.0),
        prompt_ids=prompt_ids,
        completions=completions,
        zero_std=_bool(d["zero_std"], "zero_std"),
        penalties=_decode_penalties(d["penalties"], len(completions)) if "penalties" in d else None,
        epoch=_int(d["epoch"], "epoch") if "epoch" in d else None,
        position=_int(d["position"], "position") if "position" in d else None,
    )
