"""The wire package's small forms (common.schemas): heartbeats, NCCL members, rounds and decisions. Each one's bytes
are pinned to what builds before the forms moved into the wire package wrote, so that a reader of one build and a
writer of another still agree; each round-trips, and a malformed value is one SchemaError naming what is wrong."""

from __future__ import annotations

import json

import pytest

from common.schemas import Bucket, Heartbeat, NcclDecision, NcclMember, NcclRound, SchemaError

# What the transport and the NCCL protocol (common.weights.nccl) wrote before these forms existed (json.dumps
# of the same dicts).
HEARTBEAT = '{"pid": 123, "at": 1700000000.5, "version": 2, "groups_sent": 10, "rounds": 3}'
MEMBER = '{"ranks": 2, "nonce": "n1", "group": null, "at": 1700000000.25}'
ROUND = (
    '{"session":"s1","seq":4,"version":7,"group":"grpo-run-s1-1","address":"10.0.0.1","port":29500,'
    '"world_size":3,"backend":"nccl","ranks":{"a1":1,"a2":2},'
    '"buckets":[{"names":["w","b"],"dtypes":["bfloat16","float32"],"shapes":[[2,3],[3]]}]}'
)


def a_round() -> NcclRound:
    bucket = Bucket(["w", "b"], ["bfloat16", "float32"], [[2, 3], [3]])
    return NcclRound("s1", 4, 7, "grpo-run-s1-1", "10.0.0.1", 29500, 3, "nccl", {"a1": 1, "a2": 2}, [bucket])


def test_the_bytes_are_those_earlier_builds_wrote() -> None:
    beat = Heartbeat(123, 1700000000.5, version=2, groups_sent=10, rounds=3)
    assert beat.encode() == HEARTBEAT
    assert NcclMember(2, "n1", None, 1700000000.25).encode() == MEMBER
    assert a_round().to_json() == ROUND
    assert NcclDecision("s1:4", "go").encode() == "s1:4:go"


def test_each_form_round_trips() -> None:
    beat = Heartbeat(123, 1700000000.5, version=-1, groups_sent=0, rounds=0)
    assert Heartbeat.decode(beat.encode()) == beat
    assert Heartbeat.decode(b'{"pid": 7, "at": 1.5}') == Heartbeat(7, 1.5)  # the counts are optional
    assert Heartbeat.decode(HEARTBEAT).fields() == json.loads(HEARTBEAT)
    member = NcclMember(1, "abc", "grpo-x-s-2", 5.0)
    assert NcclMember.decode(member.encode().encode()) == member
    assert NcclRound.from_json(ROUND.encode()) == a_round()
    assert NcclRound.from_json(ROUND).buckets[0].sizes() == [12, 12]  # bfloat16 2 x 3, float32 3
    no_buckets = json.dumps({k: v for k, v in json.loads(ROUND).items() if k != "buckets"})
    assert NcclRound.from_json(no_buckets).buckets == []
    for decision in ("join", "go", "cancel"):
        assert NcclDecision.decode(f"ab12:3:{decision}".encode()) == NcclDecision("ab12:3", decision)  # type: ignore[arg-type]


def _round_with(**change: object) -> str:
    return json.dumps({**json.loads(ROUND), **change})


def _bucket_with(**change: object) -> str:
    bucket = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], **change}
    return _round_with(buckets=[bucket])


@pytest.mark.parametrize(
    ("decode", "raw", "reason"),
    [
        (Heartbeat.decode, "not json", "heartbeat: not JSON"),
        (Heartbeat.decode, "[1, 2]", "expected a JSON object"),
        (Heartbeat.decode, '{"at": 1.0}', "missing ['pid']"),
        (Heartbeat.decode, '{"pid": 1, "at": 1.0, "colour": 3}', "unknown keys ['colour']"),
        (Heartbeat.decode, '{"pid": "1", "at": 1.0}', "heartbeat.pid: expected an integer"),
        (Heartbeat.decode, '{"pid": 1, "at": NaN}', "heartbeat.at"),
        (Heartbeat.decode, '{"pid": 1, "at": 1.0, "version": -2}', "heartbeat.version: -2 outside"),
        (Heartbeat.decode, b'{"pid": 1, "at": 1.0, "v\xff": 1}', "not JSON"),
        (NcclMember.decode, '{"ranks": 1, "nonce": "n", "group": null}', "missing ['at']"),
        (NcclMember.decode, '{"ranks": 0, "nonce": "n", "group": null, "at": 1.0}', "ranks: 0 outside"),
        (NcclMember.decode, '{"ranks": "2", "nonce": "n", "group": null, "at": 1.0}', "ranks: expected an integer"),
        (NcclMember.decode, '{"ranks": 1, "nonce": "n", "group": 5, "at": 1.0}', "group: expected a string"),
        (NcclRound.from_json, "{", "nccl round: not JSON"),
        (NcclRound.from_json, '{"session": "s", "seq": 1}', "nccl round: missing"),
        (NcclRound.from_json, _round_with(extra=1), "unknown keys ['extra']"),
        (NcclRound.from_json, _round_with(seq="4"), "nccl round.seq: expected an integer"),
        (NcclRound.from_json, _round_with(port=70000), "nccl round.port: 70000 outside"),
        (NcclRound.from_json, _round_with(ranks=[1]), "nccl round.ranks: expected a map"),
        (NcclRound.from_json, _round_with(ranks={"a": 0}), "nccl round.ranks.a: 0 outside"),
        (NcclRound.from_json, _bucket_with(dtypes=["complex64"]), "dtypes: 'complex64' not one of"),
        (NcclRound.from_json, _bucket_with(shapes=[[-1]]), "shapes: -1 outside"),
        (NcclRound.from_json, _bucket_with(names=["w", "b"]), "2 names, 1 dtypes and 1 shapes"),
        (NcclDecision.decode, "s1:4:maybe", "nccl decision: 'maybe'"),
        (NcclDecision.decode, "go", "nccl decision"),
        (NcclDecision.decode, b"s1:4:\xff", "not UTF-8"),
    ],
)
def test_a_malformed_value_is_one_schema_error(decode: object, raw: str | bytes, reason: str) -> None:
    with pytest.raises(SchemaError) as err:
        decode(raw)  # type: ignore[operator]
    assert reason in str(err.value) and "\n" not in str(err.value)
