"""common.schemas: round trip, strict rejection with a reason, and a fuzzed decoder that only ever says SchemaError."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.schemas import (
    SCHEMA_VERSION,
    Completion,
    FilteredStats,
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
        filtered=FilteredStats(3, 3, 24, 8.0, 0.0),
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
    assert back.filtered == msg.filtered and back.zero_std is False


def test_arrays_travel_as_little_endian_bytes_with_a_dtype() -> None:
    d = body(make_group())
    arr = d["completions"][0]["logprobs"]
    assert arr["dtype"] == "float32" and isinstance(arr["data"], bytes)
    assert np.frombuffer(arr["data"], "<f4").tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert d["v"] == SCHEMA_VERSION and d["type"] == "group"


def test_int64_and_float64_arrays_are_accepted_and_converted() -> None:
    d = body(make_group())
    d["prompt_ids"] = {"dtype": "int64", "data": np.array([1, 2], "<i8").tobytes()}
    d["completions"][0]["logprobs"] = {"dtype": "float64", "data": np.array([-1.0, -2, -3], "<f8").tobytes()}
    msg = decode_group(msgpack.packb(d, use_bin_type=True))
    assert msg.prompt_ids.dtype == np.int32 and msg.completions[0].logprobs.dtype == np.float32


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


# (field path, a value it must not have, what the error says): each one is a message that must be dead-lettered.
REJECTIONS = [
    ("v", 2, "unsupported schema version"),
    ("type", "weights", "expected 'group'"),
    ("extra", 1, "unknown keys"),
    ("policy_version", _DELETE, "missing"),
    ("policy_version", -1, "outside"),
    ("policy_version", True, "expected an integer"),
    ("policy_version", 1.5, "expected an integer"),
    ("group_id", "", "length 0"),
    ("created_at", math.nan, "not finite"),
    ("completions", [], "1..4096"),
    ("completions.0.reward", 1.5, "not finite in [0.0, 1.0]"),
    ("completions.0.reward", math.inf, "not finite"),
    ("completions.0.finish_reason", "eos", "not one of"),
    ("completions.0.logprobs", {"dtype": "float32", "data": np.zeros(2, "<f4").tobytes()}, "3 tokens but 2"),
    ("completions.0.logprobs", {"dtype": "float32", "data": np.full(3, 0.5, "<f4").tobytes()}, "<= 0"),
    ("completions.0.logprobs", {"dtype": "float32", "data": np.full(3, np.nan, "<f4").tobytes()}, "finite"),
    ("completions.0.token_ids", {"dtype": "int16", "data": b"\x00\x00"}, "dtype 'int16'"),
    ("completions.0.token_ids", {"dtype": "int32", "data": b"\x00\x00\x00"}, "whole number"),
    ("completions.0.token_ids", {"dtype": "int32", "data": np.array([-1, 2, 3], "<i4").tobytes()}, "[0, 2^31)"),
    ("completions.0.token_ids", [1, 2, 3], "expected a map"),
    ("prompt_ids", {"dtype": "int32", "data": b""}, "outside [1"),
    ("filtered.zero_std_groups", 9, "outside"),
    ("filtered.reward_sum", 1e9, "exceed"),
    ("zero_std", 0, "expected a boolean"),
]


@pytest.mark.parametrize(("path", "value", "reason"), REJECTIONS)
def test_rejects_with_a_reason(path: str, value: object, reason: str) -> None:
    with pytest.raises(SchemaError, match=None) as e:
        decode_group(mutated(path, value))
    assert reason in str(e.value)


@pytest.mark.parametrize("raw", [b"", b"\xc1", b"not msgpack at all", msgpack.packb([1, 2, 3]), msgpack.packb("x")])
def test_garbage_is_a_schema_error(raw: bytes) -> None:
    with pytest.raises(SchemaError):
        decode_group(raw)


def test_weights_announcement_hash_round_trip_and_validation() -> None:
    ann = WeightsAnnouncement(3, "/w/v000003", "a" * 64)
    back = WeightsAnnouncement.from_hash({k.encode(): v.encode() for k, v in ann.to_hash().items()})
    assert back == ann
    with pytest.raises(SchemaError):
        WeightsAnnouncement.from_hash({"version": "x"})
    with pytest.raises(SchemaError):
        WeightsAnnouncement.from_hash({**ann.to_hash(), "sha256": "short"})


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
    else:  # ... or one field nested inside a completion, an array, or the filtered summary
        d = body(make_group(2))
        node = data.draw(
            st.sampled_from(
                [
                    d["completions"][0],
                    d["completions"][1]["token_ids"],
                    d["filtered"],
                    d["prompt_ids"],
                    d["completions"][0]["logprobs"],
                ]
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
