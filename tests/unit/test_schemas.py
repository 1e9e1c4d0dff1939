"""common.schemas: round trip, strict rejection with a reason, and a fuzzed decoder that only ever says SchemaError."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.schemas import (
    SCHEMA_VERSION,
    Completion,
    GroupMessage,
    SchemaError,
    WeightsAnnouncement,
    decode_group,
    encode_group,
)


def make_group(n: int = 4, **kw: object) -> GroupMessage:
    comps = tuple(
        Completion(
            np.array([5 + i, 6, 2], dtype=np.int32),
            np.array([-0.1, -0.2, -0.3 * (i + 1)], dtype=np.float32),
            float(i % 2),
            "stop" if i else "length",
        )
        for i in range(n)
    )
    fields: dict = dict(
        prompt_id="add-3-5",
        policy_version=7,
        actor_id="actor-1",
        prompt_ids=np.array([1, 7, 14, 9, 17], dtype=np.int32),
        completions=comps,
        penalties=np.array([0.0, -0.25, -0.5, -1.0][:n], dtype=np.float32),
    )
    fields.update(kw)
    return GroupMessage(**fields)


def body(msg: GroupMessage) -> dict:
    return msgpack.unpackb(encode_group(msg), raw=False)


def test_round_trip_preserves_everything() -> None:
    msg = make_group()
    back = decode_group(encode_group(msg))
    assert (back.group_id, back.prompt_id, back.policy_version, back.actor_id) == (
        msg.group_id, msg.prompt_id, 7, "actor-1")  # fmt: skip
    assert back.created_at == msg.created_at
    np.testing.assert_array_equal(back.prompt_ids, msg.prompt_ids)
    for a, b in zip(back.completions, msg.completions, strict=True):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        assert (a.reward, a.finish_reason) == (b.reward, b.finish_reason)
    assert back.zero_std is False
    assert back.penalties is not None and msg.penalties is not None
    np.testing.assert_array_equal(back.penalties, msg.penalties)


def test_arrays_travel_as_little_endian_bytes_with_a_dtype_and_completions_as_columns() -> None:
    msg = make_group()
    d = body(msg)
    assert d["v"] == SCHEMA_VERSION == 6 and d["type"] == "group"
    c = d["completions"]
    assert set(c) == {"lengths", "token_ids", "logprobs", "rewards", "finish_reasons"}
    assert all(
        c[k]["dtype"] in {"int32", "float32", "float64"} and isinstance(c[k]["data"], bytes)
        for k in c
        if k != "finish_reasons"
    )
    assert np.frombuffer(c["lengths"]["data"], "<i4").tolist() == [3, 3, 3, 3]
    assert np.frombuffer(c["token_ids"]["data"], "<i4").tolist() == [5, 6, 2, 6, 6, 2, 7, 6, 2, 8, 6, 2]
    assert np.frombuffer(c["logprobs"]["data"], "<f4")[:3].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert np.frombuffer(c["rewards"]["data"], "<f8").tolist() == [0.0, 1.0, 0.0, 1.0]
    assert c["finish_reasons"] == ["length", "stop", "stop", "stop"]


def test_a_groups_completions_are_views_of_its_columns() -> None:
    back = decode_group(encode_group(make_group()))
    cols = back.columns
    assert len(back.completions) == 4 and cols.offsets.tolist() == [0, 3, 6, 9, 12]
    third = back.completions[2]
    assert np.shares_memory(third.token_ids, cols.token_ids) and third.token_ids.tolist() == [7, 6, 2]
    assert back.completions[-1].reward == 1.0 and [c.finish_reason for c in back.completions[1:3]] == ["stop", "stop"]
    assert back.rewards == [0.0, 1.0, 0.0, 1.0]
    with pytest.raises(IndexError):
        back.completions[4]


_NOTHING_FILTERED = {"groups": 0, "zero_std_groups": 0, "completions": 0, "reward_sum": 0.0, "reward_std_sum": 0.0}


def v2_body(msg: GroupMessage, filtered: dict | None = None) -> dict:
    """What a build before schema version 3 wrote: a summary of filtered groups, and no penalties."""
    d = body(msg)
    d["v"] = 2
    del d["penalties"]
    d["filtered"] = filtered or _NOTHING_FILTERED
    return d


def test_version_2_groups_are_read_and_their_filtered_summary_skipped() -> None:
    # The summary was always empty in what actors sent since the filter's figures moved to Redis: whatever it holds,
    # the learner reads those figures from Redis alone (one source), and the group itself is trained.
    msg = make_group()
    for summary in (None, {"groups": 3, "zero_std_groups": 3, "completions": 24, "reward_sum": 8.0,
                           "reward_std_sum": 0.0}):  # fmt: skip
        back = decode_group(msgpack.packb(v2_body(msg, summary), use_bin_type=True))
        assert back.group_id == msg.group_id and back.penalties is None
        np.testing.assert_array_equal(back.columns.token_ids, msg.columns.token_ids)
    with_penalties = v2_body(msg) | {"penalties": body(msg)["penalties"]}  # a field version 2 never had
    with pytest.raises(SchemaError, match="unknown keys"):
        decode_group(msgpack.packb(with_penalties, use_bin_type=True))
    no_summary = v2_body(msg)
    del no_summary["filtered"]
    with pytest.raises(SchemaError, match=r"missing \['filtered'\]"):
        decode_group(msgpack.packb(no_summary, use_bin_type=True))


def v1_body(msg: GroupMessage) -> dict:
    """What a build before schema version 2 wrote: one map per completion."""
    d = v2_body(msg)
    d["v"] = 1
    d["completions"] = [
        {
            "token_ids": {"dtype": "int32", "data": c.token_ids.astype("<i4").tobytes()},
            "logprobs": {"dtype": "float32", "data": c.logprobs.astype("<f4").tobytes()},
            "reward": c.reward,
            "finish_reason": c.finish_reason,
        }
        for c in msg.completions
    ]
    return d


def test_version_1_groups_left_in_a_stream_are_still_read() -> None:
    msg = make_group()
    back = decode_group(msgpack.packb(v1_body(msg), use_bin_type=True))
    for a, b in zip(back.completions, msg.completions, strict=True):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        assert (a.reward, a.finish_reason) == (b.reward, b.finish_reason)
    bad = v1_body(msg)
    bad["completions"][1]["logprobs"] = {"dtype": "float32", "data": np.zeros(2, "<f4").tobytes()}
    with pytest.raises(SchemaError, match=r"completions\[1\]: 3 tokens but 2"):
        decode_group(msgpack.packb(bad, use_bin_type=True))


def test_tokens_of_several_versions_travel_as_runs_and_a_single_version_sends_none() -> None:
    runs = [np.array([[6, 1], [7, 2]]), None, np.array([[7, 3]]), np.array([[5, 3]])]
    comps = [replace(c, runs=r) for c, r in zip(make_group().completions, runs, strict=True)]
    back = decode_group(encode_group(make_group(completions=comps)))
    assert back.columns.runs is not None
    assert back.columns.runs.token_versions().tolist() == [6, 7, 7, 7, 7, 7, 7, 7, 7, 5, 5, 5]
    assert back.completions[0].runs.tolist() == [[6, 1], [7, 2]]  # type: ignore[union-attr]
    assert back.completions[1].runs.tolist() == [[7, 3]]  # type: ignore[union-attr]
    assert back.columns.runs.counts.tolist() == [2, 1, 1, 1]
    # Every token of the group's own version: nothing to say, nothing sent.
    same = [replace(c, runs=np.array([[7, 3]])) for c in make_group().completions]
    assert "versions" not in body(make_group(completions=same))["completions"]
    assert decode_group(encode_group(make_group(completions=same))).columns.runs is None


def test_a_group_carries_its_prompt_position_from_version_6_on() -> None:
    back = decode_group(encode_group(make_group(position=41)))
    assert back.position == 41 and decode_group(encode_group(make_group())).position is None
    d = body(make_group(position=41))
    assert d["position"] == 41
    d["v"] = 5  # version 5 had none
    with pytest.raises(SchemaError, match="unknown keys"):
        decode_group(msgpack.packb(d, use_bin_type=True))
    del d["position"]
    assert decode_group(msgpack.packb(d, use_bin_type=True)).position is None


def test_version_3_groups_without_runs_are_still_read() -> None:
    d = body(make_group())
    d["v"] = 3
    back = decode_group(msgpack.packb(d, use_bin_type=True))
    assert back.policy_version == 7 and back.columns.runs is None
    d["completions"]["versions"] = _RUNS  # version 3 had none
    with pytest.raises(SchemaError, match="unknown keys"):
        decode_group(msgpack.packb(d, use_bin_type=True))


def test_int64_and_float32_arrays_are_accepted_and_converted() -> None:
    d = body(make_group())
    d["prompt_ids"] = {"dtype": "int64", "data": np.array([1, 2], "<i8").tobytes()}
    c = d["completions"]
    c["logprobs"] = {"dtype": "float64", "data": np.full(12, -1.0, "<f8").tobytes()}
    c["lengths"] = {"dtype": "int64", "data": np.full(4, 3, "<i8").tobytes()}
    c["rewards"] = {"dtype": "float32", "data": np.array([0, 1, 0, 0.5], "<f4").tobytes()}
    msg = decode_group(msgpack.packb(d, use_bin_type=True))
    assert msg.prompt_ids.dtype == np.int32 and msg.completions[0].logprobs.dtype == np.float32
    assert msg.rewards == [0.0, 1.0, 0.0, 0.5]


def mutated(path: str, value: object) -> bytes:
    d = body(make_group())
    node = d
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if k.isdigit() else node[k]
    last = keys[-1]
    if value is _DELETE:
        del node[last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return msgpack.packb(d, use_bin_type=True)


_DELETE = object()


def _i32(*v: int) -> dict:
    return {"dtype": "int32", "data": np.array(v, "<i4").tobytes()}


def _f32(*v: float) -> dict:
    return {"dtype": "float32", "data": np.array(v, "<f4").tobytes()}


def _f64(*v: float) -> dict:
    return {"dtype": "float64", "data": np.array(v, "<f8").tobytes()}


_LP = [-0.1] * 12

# (field path, a value it must not have, what the error says): each one is a message that must be dead-lettered.
REJECTIONS = [
    ("v", 7, "unsupported schema version"),
    ("position", -1, "position: -1 outside"),
    ("position", "3", "position: expected an integer"),
    ("v", "5", "unsupported schema version"),
    ("type", "weights", "expected 'group'"),
    ("extra", 1, "unknown keys"),
    ("policy_version", _DELETE, "missing"),
    ("policy_version", -1, "outside"),
    ("policy_version", True, "expected an integer"),
    ("policy_version", 1.5, "expected an integer"),
    ("group_id", "", "length 0"),
    ("created_at", math.nan, "not finite"),
    ("completions", [], "expected a map"),
    ("completions.finish_reasons", [], "1..4096"),
    ("completions.finish_reasons", ["stop", "eos", "stop", "stop"], "completions[1].finish_reason: 'eos' not one of"),
    ("completions.finish_reasons", ["stop", ["x"], "stop", "stop"], "completions[1].finish_reason"),
    ("completions.rewards", _f64(0, 1, 1.5, 0), "completions[2].reward: 1.5 is not finite in [0.0, 1.0]"),
    ("completions.rewards", _f64(0, 1, 0, math.inf), "completions[3].reward: inf is not finite"),
    ("completions.rewards", _f64(0, math.nan, 0, 1), "completions[1].reward: nan is not finite"),
    ("completions.rewards", _f64(0, 1, 0), "4 finish reasons but 4 lengths and 3 rewards"),
    ("completions.lengths", _i32(3, 3, 3), "4 finish reasons but 3 lengths"),
    ("completions.lengths", _i32(3, 3, 0, 6), "at least one token"),
    ("completions.lengths", _i32(3, 3, 3, 4), "lengths add up to 13 tokens but token_ids has 12"),
    ("completions.logprobs", _f32(*[-0.1] * 11), "12 tokens but 11 log-probs"),
    ("completions.logprobs", _f32(*_LP[:4], 0.5, *_LP[5:]), "completions[1].logprobs: must be finite and <= 0"),
    ("completions.logprobs", _f32(*_LP[:9], math.nan, *_LP[10:]), "completions[3].logprobs: must be finite"),
    ("completions.logprobs", _f32(*_LP[:2], -math.inf, *_LP[3:]), "completions[0].logprobs: must be finite"),
    # Finite but absurd: -1e30 passed once and made every update of a step non-finite.
    ("completions.logprobs", _f32(*_LP[:6], -1e30, *_LP[7:]), "completions[2].logprobs: must be finite and <= 0, and"),
    ("completions.logprobs", _f32(*_LP[:11], -2e4), "completions[3].logprobs: must be finite and <= 0, and >= -10000"),
    ("completions.token_ids", {"dtype": "int16", "data": b"\x00\x00"}, "dtype 'int16'"),
    ("completions.token_ids", {"dtype": "int32", "data": b"\x00\x00\x00"}, "whole number"),
    (
        "completions.token_ids",
        _i32(1, 2, 3, 4, 5, 6, -1, 8, 9, 10, 11, 12),
        "completions[2].token_ids: token ids must be in",
    ),
    (
        "completions.token_ids",
        {"dtype": "int64", "data": np.array([2**32] * 12, "<i8").tobytes()},
        "values must be in [0, 2^31)",
    ),
    ("completions.token_ids", [1, 2, 3], "expected a map"),
    ("completions.lengths", _DELETE, "missing ['lengths']"),
    ("prompt_ids", {"dtype": "int32", "data": b""}, "outside [1"),
    ("penalties", _f32(0.0, -0.5, 0.25, 0.0), "penalties: each is finite in"),
    ("penalties", _f32(0.0, math.nan, 0.0, 0.0), "penalties: each is finite in"),
    ("penalties", _f32(0.0, -0.5), "penalties: 2 for 4 completions"),
    ("filtered", {"groups": 0}, "unknown keys ['filtered']"),  # version 3 has no summary
    ("zero_std", 0, "expected a boolean"),
]


# Which version produced which tokens (schema 4): the group of make_group has 4 completions of 3 tokens, version 7.
_RUNS = {"runs": _i32(2, 1, 1, 1), "version": _i32(6, 7, 7, 5, 7), "tokens": _i32(1, 2, 3, 3, 3)}
REJECTIONS += [
    ("completions.versions", {**_RUNS, "runs": _i32(2, 1, 1)}, "3 run counts for 4 completions"),
    ("completions.versions", {**_RUNS, "tokens": _i32(1, 2, 3, 3)}, "5 versions but 4 token counts"),
    ("completions.versions", {**_RUNS, "runs": _i32(2, 1, 1, 2)}, "add up to the 5 runs"),
    ("completions.versions", {**_RUNS, "tokens": _i32(0, 3, 3, 3, 3)}, "at least one token"),
    (
        "completions.versions",
        {**_RUNS, "tokens": _i32(1, 1, 3, 3, 3)},
        "completions[0].versions: runs of 2 tokens for 3",
    ),
    ("completions.versions", {**_RUNS, "version": _i32(7, 6, 7, 5, 7)}, "completions[0].versions: versions must rise"),
    ("completions.versions", {**_RUNS, "version": _i32(5, 6, 6, 5, 6)}, "the newest version 6 is not policy_version 7"),
    ("completions.versions", {**_RUNS, "version": _i32(6, 8, 8, 5, 8)}, "newest version 8 is not policy_version 7"),
    ("completions.versions", {"runs": _RUNS["runs"]}, "missing"),
]


@pytest.mark.parametrize(("path", "value", "reason"), REJECTIONS)
def test_rejects_with_a_reason(path: str, value: object, reason: str) -> None:
    with pytest.raises(SchemaError, match=None) as e:
        decode_group(mutated(path, value))
    assert reason in str(e.value), str(e.value)


@pytest.mark.parametrize("raw", [b"", b"\xc1", b"not msgpack at all", msgpack.packb([1, 2, 3]), msgpack.packb("x")])
def test_garbage_is_a_schema_error(raw: bytes) -> None:
    with pytest.raises(SchemaError):
        decode_group(raw)


def test_weights_announcement_hash_round_trip_and_validation() -> None:
    for digest in ("xxh3-128:" + "a" * 32, "sha256:" + "0123456789abcdef" * 4):
        ann = WeightsAnnouncement(3, "/w/v000003", digest)
        back = WeightsAnnouncement.from_hash({k.encode(): v.encode() for k, v in ann.to_hash().items()})
        assert back == ann and back.digest_algorithm == digest.split(":")[0]
    with pytest.raises(SchemaError):
        WeightsAnnouncement.from_hash({"version": "x"})
    for bad in ("xxh3-128:short", "sha256:" + "a" * 32, "md5:" + "a" * 32, "a" * 64, "xxh3-128:" + "G" * 32):
        with pytest.raises(SchemaError, match="digest"):
            WeightsAnnouncement.from_hash({**ann.to_hash(), "digest": bad})
    # What builds before the digest field announced: a bare sha256.
    legacy = {k: v for k, v in ann.to_hash().items() if k != "digest"} | {"sha256": "b" * 64}
    assert WeightsAnnouncement.from_hash(legacy).digest == "sha256:" + "b" * 64


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"digest": "blake3:" + "a" * 32}, "digest 'blake3:"),
        ({"uri": None}, "missing uri"),
        ({"version": "seven"}, "malformed field"),
        ({"version": "9" * 30}, "outside"),
        ({"format": "hf-safetensors-v9"}, "format 'hf-safetensors-v9' unknown to this build"),
        ({"uri": ""}, "uri of 0 characters"),
        ({"uri": b"/w/\xff"}, "not UTF-8"),
        ({"published_at": "yesterday"}, "malformed field"),
    ],
)
def test_a_malformed_weights_hash_is_one_schema_error(change: dict, reason: str) -> None:  # type: ignore[type-arg]
    """One HSET by hand, or a newer build's announcement: a one-line SchemaError that every reader handles as bad
    input (never an exception of another kind, never an announcement of a format this build cannot load)."""
    h: dict[str, object] = dict(WeightsAnnouncement(3, "/w/v000003", "xxh3-128:" + "a" * 32).to_hash())
    h.update(change)
    h = {k: v for k, v in h.items() if v is not None}
    with pytest.raises(SchemaError, match=re.escape(reason)) as caught:
        WeightsAnnouncement.from_hash(h)
    assert "\n" not in str(caught.value)
    assert WeightsAnnouncement.from_hash({**h, **WeightsAnnouncement(3, "/w/v3", "xxh3-128:" + "a" * 32).to_hash()})


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _fuzz(data: st.DataObject) -> None:
    choice = data.draw(st.integers(0, 3))
    if choice == 0:  # arbitrary bytes
        raw = data.draw(st.binary(max_size=256))
    elif choice == 1:  # arbitrary msgpack values
        raw = msgpack.packb(data.draw(_msgpack_values), use_bin_type=True)
    elif choice == 2:  # a valid message with one field replaced by an arbitrary value
        d = body(make_group(2))
        key = data.draw(st.sampled_from(sorted(d)))
        d[key] = data.draw(_msgpack_values)
        raw = msgpack.packb(d, use_bin_type=True)
    else:  # ... or one field nested inside a completion, an array, or the penalties
        d = body(make_group(2))
        c = d["completions"]
        node = data.draw(
            st.sampled_from(
                [c, c["token_ids"], c["logprobs"], c["lengths"], c["rewards"], d["penalties"], d["prompt_ids"]]
            )
        )
        node[data.draw(st.sampled_from(sorted(node)))] = data.draw(_msgpack_values)
        raw = msgpack.packb(d, use_bin_type=True)
    try:
        msg = decode_group(raw)
    except SchemaError:
        return
    assert isinstance(msg, GroupMessage)  # whatever decodes is a whole, valid message


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_decoder_only_raises_schema_error(data: st.DataObject) -> None:
    _fuzz(data)


@pytest.mark.slow
@settings(max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_decoder_only_raises_schema_error_10k(data: st.DataObject) -> None:
    _fuzz(data)
