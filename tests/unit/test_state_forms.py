"""The wire package's forms of the run's state in Redis (common.schemas.state): the counters, the run's identity, the
done mark, a dead letter, a reservation and the weights channel's message. Each one's bytes are pinned to what the
transport wrote before the forms existed, each round-trips, a malformed value is one SchemaError naming what is
wrong, and the Lua scripts that write some of them name only fields the forms read."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from common.schemas import (
    DEAD_LETTER_FIELDS,
    DeadLetter,
    DoneMark,
    Reservation,
    RunCounters,
    RunIdentity,
    SchemaError,
    counter,
    weights_wakeup,
)

COMMON = Path(__file__).resolve().parents[2] / "common"


def test_counters_read_every_kind_and_keep_a_newer_builds_apart() -> None:
    raw = {b"groups_produced": b"12", b"groups_trained": b"7", b"groups_dead": b"1", b"groups_replayed": b"1",
           b"zero_std_forwarded": b"2", b"groups_dropped:stale": b"3", b"groups_filtered:zero_std": b"40",
           b"groups_discarded:stopped": b"4", b"groups_requeued": b"5"}  # fmt: skip
    c = RunCounters.from_hash(raw)
    assert (c.produced, c.trained, c.dead, c.replayed, c.forwarded) == (12, 7, 1, 1, 2)
    assert (c.dropped, c.filtered, c.discarded) == ({"stale": 3}, {"zero_std": 40}, {"stopped": 4})
    assert c.other == {"groups_requeued": 5}  # kept, outside the equation
    odd = RunCounters.from_hash({b"groups_dropped:Too-Stale": b"2"})  # any reason is read: none falls out of it
    assert odd.dropped == {"Too-Stale": 2} and odd.other == {}
    assert c.to_hash() == {k.decode(): int(v) for k, v in raw.items()}  # the hash as Redis holds it
    assert RunCounters.from_hash({}) == RunCounters() and RunCounters().to_hash() == {}
    assert counter("dropped", "stale") == "groups_dropped:stale"
    for kind, reason in [("lost", "x"), ("dropped", ""), ("dropped", "a:b"), ("filtered", "Zero")]:
        with pytest.raises(ValueError):
            counter(kind, reason)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ({b"groups_produced": b"x"}, "stats.groups_produced: 'x' is not a count"),
        ({b"groups_trained": b"-1"}, "stats.groups_trained: '-1' is not a count"),
        ({b"groups_dead": b"1.5"}, "is not a count"),
        ({b"\xff": b"1"}, "not UTF-8"),
        ({b"groups_dead": b"\xd9\xa3"}, "is not a count"),  # an Arabic-Indic digit is no count of Redis's
    ],
)
def test_a_malformed_counter_is_one_schema_error(raw: dict[bytes, bytes], reason: str) -> None:
    with pytest.raises(SchemaError, match=re.escape(reason)):
        RunCounters.from_hash(raw)


def test_identity_fields_are_those_the_learner_wrote_and_read_back() -> None:
    assert RunIdentity.first_fields("r1", 1700000000.25) == {"id": "r1", "created_at": "1700000000.25"}
    reset = RunIdentity.reset_fields("r1", 1700000100.5, 42, 336)
    assert reset == {"id": "r1", "reset_at": "1700000100.5", "reset_step": "42", "trained_before_reset": "336"}
    fresh = RunIdentity.from_hash({b"id": b"r1", b"created_at": b"1700000000.25"})
    assert fresh == RunIdentity("r1", 1700000000.25)
    assert (fresh.reset_at, fresh.reset_step, fresh.trained_before_reset, fresh.resets) == (None, None, 0, 0)
    after = RunIdentity.from_hash({**RunIdentity.first_fields("r1", 1700000000.25), **reset, "resets": b"2"})
    assert after == RunIdentity("r1", 1700000000.25, 1700000100.5, 42, 336, 2)
    newer = RunIdentity.from_hash({b"id": b"r1", b"created_at": b"1.5", b"region": b"eu"})  # a newer build's field
    assert newer == RunIdentity("r1", 1.5)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ({"created_at": "1"}, "identity: missing ['id']"),
        ({"id": "r", "created_at": "soon"}, "identity.created_at: 'soon' is not a time"),
        ({"id": "r", "created_at": b"\xff"}, "identity.created_at: a value that is not UTF-8 text"),
        ({"id": "", "created_at": "1"}, "identity.id: length 0"),
        ({"id": "r", "created_at": "1", "reset_at": "2"}, "reset_at and reset_step go together"),
        ({"id": "r", "created_at": "1", "resets": "-1"}, "identity.resets: '-1' is not a count"),
        ({"id": "r", "created_at": "-5"}, "is not a time in seconds"),
    ],
)
def test_a_malformed_identity_is_one_schema_error(raw: dict[str, str], reason: str) -> None:
    with pytest.raises(SchemaError, match=re.escape(reason)):
        RunIdentity.from_hash(raw)


def test_done_mark_reservation_and_wakeup_are_the_bytes_written_before() -> None:
    assert DoneMark(1700000000.125).encode() == "1700000000.125"  # repr of Redis's clock, as mark_done wrote it
    assert DoneMark.decode(b"1700000000.125") == DoneMark(1700000000.125)
    assert Reservation(8, 1700000000123).encode() == "8 1700000000123"  # the admission script's "<n> <end ms>"
    assert Reservation.decode(b"8 1700000000123") == Reservation(8, 1700000000123)
    assert weights_wakeup(12) == "12"
    for raw in (b"", b"8", b"8 x", b"-1 5", b"8  5", b"8 5 1", "8 1.5"):
        with pytest.raises(SchemaError, match=r"reservation: .* is not '<groups> <lease end ms>'"):
            Reservation.decode(raw)
    for raw in (b"nan", b"yesterday", b"-1", b"\xff"):
        with pytest.raises(SchemaError, match="done: "):
            DoneMark.decode(raw)


def _letter(change: dict[bytes, bytes | None] | None = None) -> dict[bytes, bytes]:
    fields = {b"reason": b"not msgpack", b"payload": b"\x00\x01", b"source_id": b"1-0", b"at": b"1700000000.5",
              b"size": b"2", **(change or {})}  # fmt: skip
    return {k: v for k, v in fields.items() if v is not None}


def test_a_dead_letter_reads_both_writers_entries() -> None:
    letter = DeadLetter.from_fields("5-0", _letter())
    assert letter == DeadLetter("5-0", "not msgpack", b"\x00\x01", "1-0", 1700000000.5, 2)
    assert {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in letter.to_fields().items()} == _letter()
    # The delivery script's, for an oversized message: a prefix, marked.
    prefix = DeadLetter.from_fields("6-0", _letter({b"size": b"9000", b"truncated": b"1"}))
    assert prefix.truncated and prefix.size == 9000 and prefix.to_fields()["truncated"] == "1"
    assert tuple(prefix.to_fields()) == DEAD_LETTER_FIELDS
    # Builds before the size field wrote four fields, the whole message kept; a newer build's field is left unread.
    older = DeadLetter.from_fields("7-0", _letter({b"size": None}))
    assert older == DeadLetter("7-0", "not msgpack", b"\x00\x01", "1-0", 1700000000.5, 2)
    assert DeadLetter.from_fields("8-0", _letter({b"learner": b"l-1"})) == replace(older, id="8-0")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({b"reason": None}, "dead letter 1-0: missing ['reason']"),
        ({b"source_id": None}, "dead letter 1-0: missing ['source_id']"),
        ({b"truncated": b"\xff"}, "dead letter 1-0.truncated: a value that is not UTF-8 text"),
        ({b"size": b"3"}, "dead letter 1-0: size 3 for a payload of 2 bytes"),
        ({b"size": b"1", b"truncated": b"1"}, "size 1 for a payload of 2 bytes"),
        ({b"truncated": b"yes"}, "truncated is 'yes', not 1"),
        ({b"at": b"now"}, "dead letter 1-0.at: 'now' is not a time"),
    ],
)
def test_a_malformed_dead_letter_is_one_schema_error(change: dict[bytes, bytes | None], reason: str) -> None:
    with pytest.raises(SchemaError, match=re.escape(reason)):
        DeadLetter.from_fields("1-0", _letter(change))


def _lua_scripts() -> str:
    return "\n".join(p.read_text() for p in sorted((COMMON / "transport").glob("*.py")))


def test_the_scripts_count_only_what_the_counters_form_reads() -> None:
    """Every counter a Lua script bumps by a literal name is one RunCounters reads (not a newer build's ``other``),
    and a script's dead letter has exactly the dead-letter form's fields."""
    lua = _lua_scripts()
    named = set(re.findall(r"HINCRBY', KEYS\[2\], '([a-z_:]+)'", lua))
    assert named == {"groups_produced", "groups_trained", "groups_dead", "groups_replayed", "prompts_trained",
                     "prompts_retrained"}, named  # fmt: skip
    # The prompt scripts' counters (stats is their KEYS[4], or the requeue function's argument), by name or reason
    named |= set(re.findall(r"HINCRBY', (?:KEYS\[4\]|stats), '([a-z_:]+)'", lua))
    named = {n for n in named if not n.endswith(":")}  # ('prompts_requeued:' .. why, the reasons below)
    named |= {"prompts_requeued:" + why for why in re.findall(r"requeue\([^,]+, '([a-z_]+)'", lua)}
    assert {"prompts_drawn", "prompts_redrawn", "prompts_requeued:lost", "prompts_requeued:released"} <= named
    read = RunCounters.from_hash({n: 1 for n in named})
    assert read.other == {} and read.to_hash() == {n: 1 for n in named}  # every one read, none lost on the way
    writes = re.findall(r"'XADD', KEYS\[3\], 'MAXLEN', '~', ARGV\[6\], '\*',(.*?)\)\n", lua, re.S)
    assert len(writes) == 2, writes  # the learner's dead-lettering and the delivery's of an oversized entry
    for w in writes:
        names = tuple(re.findall(r"'([a-z_]+)',\s*(?:ARGV|reason|prefix|id|size|'1'|#)", w))
        assert names in (DEAD_LETTER_FIELDS, DEAD_LETTER_FIELDS[:5]), names
    assert re.search(r"string\.match\(held\[i \+ 1\], '\^\(%d\+\) \(%d\+\)\$'\)", lua)  # the Reservation form
