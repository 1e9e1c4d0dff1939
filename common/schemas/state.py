"""The wire package's forms of the run's state in Redis (see common.schemas, its face): the durable counters
(hash ``stats``), the run's identity (hash ``identity``), the done mark (string ``done``), a dead letter (an entry of
the stream ``dead``), a round's reservation (a field of the hash ``inflight``) and the message on the ``weights``
channel. Several are written inside Lua scripts (common.transport), so that a count and the operation it counts are
one step; those scripts write exactly the forms here, and tests read what the scripts wrote back through them."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from common.schemas.fields import SchemaError, as_text
from common.schemas.prompts import PromptCounters, is_prompt_field

# --- the durable counters (hash ``stats``; DESIGN §4's accounting equation is read from them) -------------------

PRODUCED = "groups_produced"  # XADDed by actors (and by a replay of a dead letter)
TRAINED = "groups_trained"  # acknowledged by the learner once a checkpoint covers them
DEAD = "groups_dead"  # moved to the dead stream
REPLAYED = "groups_replayed"  # dead letters put back into the groups stream (counted produced again)
FORWARDED = "zero_std_forwarded"  # all-equal groups an actor sent anyway, its resampling budget spent
# Counted by reason: dropped by the learner (e.g. stale), filtered out by an actor (never sent, e.g. zero_std),
# discarded by an actor (sampled, never sent, e.g. stopped).
CounterKind = Literal["dropped", "filtered", "discarded"]
# Why the learner refuses a group (``groups_dropped:<reason>``, and the metric's ``reason`` label).
DropReason = Literal["group_size", "lineage", "future", "stale", "duplicate", "nonfinite"]
COUNTER_KINDS: tuple[CounterKind, ...] = ("dropped", "filtered", "discarded")
_PLAIN = (PRODUCED, TRAINED, DEAD, REPLAYED, FORWARDED)


def counter(kind: CounterKind, reason: str) -> str:
    """The ``stats`` field counting groups ``kind`` for ``reason``: ``groups_<kind>:<reason>``."""
    if kind not in COUNTER_KINDS or not re.fullmatch(r"[a-z0-9_]{1,64}", reason):
        raise ValueError(f"no counter groups_{kind}:{reason}")
    return f"groups_{kind}:{reason}"


@dataclass(frozen=True)
class RunCounters:
    """The ``stats`` hash, read: every field an integer ≥ 0 named :data:`PRODUCED`, :data:`TRAINED`,
    :data:`DEAD`, :data:`REPLAYED`, :data:`FORWARDED` or ``groups_<kind>:<reason>`` (:func:`counter`); an absent
    field is 0. A counter this build does not name (a newer build's) is kept in ``other``, outside the equation:
    the hash outlives every process, and a learner must not stop on a count it has no use for. The ``prompts_*``
    fields are the prompts' own equation's (:class:`common.schemas.prompts.PromptCounters`)."""

    produced: int = 0
    trained: int = 0
    dead: int = 0
    replayed: int = 0
    forwarded: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    filtered: dict[str, int] = field(default_factory=dict)
    discarded: dict[str, int] = field(default_factory=dict)
    other: dict[str, int] = field(default_factory=dict)
    prompts: PromptCounters = field(default_factory=PromptCounters)

    def to_hash(self) -> dict[str, int]:
        """The fields that are not 0, as Redis holds them."""
        plain = dict(zip(_PLAIN, (self.produced, self.trained, self.dead, self.replayed, self.forwarded), strict=True))
        by_reason = {counter(k, r): n for k in COUNTER_KINDS for r, n in getattr(self, k).items()}
        return {name: n for name, n in {**plain, **by_reason, **self.other, **self.prompts.to_hash()}.items() if n}

    @classmethod
    def from_hash(cls, h: Mapping[Any, Any]) -> RunCounters:
        plain = {name: 0 for name in _PLAIN}
        by_kind: dict[str, dict[str, int]] = {k: {} for k in (*COUNTER_KINDS, "other", "prompts")}
        for k, v in h.items():
            name = _text(k, "stats")
            n = _count(v, f"stats.{name[:80]}")
            if name in plain:
                plain[name] = n
            elif is_prompt_field(name):
                by_kind["prompts"][name] = n
            # Any reason is read (counter() is strict only about what this build writes): a count by reason that
            # fell outside the equation would make the accounting look unbalanced.
            elif (m := re.fullmatch(r"groups_(dropped|filtered|discarded):(.+)", name, re.S)) is not None:
                by_kind[m.group(1)][m.group(2)] = n
            else:
                by_kind["other"][name] = n
        return cls(
            produced=plain[PRODUCED], trained=plain[TRAINED], dead=plain[DEAD], replayed=plain[REPLAYED],
            forwarded=plain[FORWARDED], dropped=by_kind["dropped"], filtered=by_kind["filtered"],
            discarded=by_kind["discarded"], other=by_kind["other"],
            prompts=PromptCounters.from_counts(by_kind["prompts"]),
        )  # fmt: skip


def _text(v: bytes | str, where: str) -> str:
    try:
        return as_text(v)
    except UnicodeDecodeError:
        raise SchemaError(f"{where}: a value that is not UTF-8 text") from None


def _count(v: Any, where: str) -> int:
    """A count as Redis replies with it (decimal digits) or as a default (an int): an integer ≥ 0."""
    s = _text(v, where) if isinstance(v, (bytes, str)) else v
    if isinstance(s, int) and not isinstance(s, bool) and s >= 0:
        return s
    if isinstance(s, str) and re.fullmatch(r"[0-9]{1,19}", s):
        return int(s)
    raise SchemaError(f"{where}: {str(s)[:40]!r} is not a count")


def _seconds(v: bytes | str, where: str) -> float:
    s = _text(v, where)
    try:
        t = float(s)
    except ValueError:
        raise SchemaError(f"{where}: {s[:40]!r} is not a time") from None
    if not 0 <= t < 1e11:
        raise SchemaError(f"{where}: {t} is not a time in seconds since the epoch")
    return t


# --- the run's identity (hash ``identity``: learner → learners, ``grpo status``) ----------------------------------


@dataclass(frozen=True)
class RunIdentity:
    """Which run Redis holds under this run name (learner → hash ``identity`` → every learner that starts or resumes,
    and ``grpo status``): ``id`` and ``created_at`` (Redis's clock, seconds), and, once a learner found this Redis had
    lost the run's state, ``reset_at``, ``reset_step`` (its step then), ``trained_before_reset`` (the groups trained
    before, no longer in ``stats``) and ``resets`` (how many times). Written field by field (HSETNX of the first two
    whoever comes first; HSET of the reset's), so the form gives the fields of each write."""

    id: str
    created_at: float
    reset_at: float | None = None
    reset_step: int | None = None
    trained_before_reset: int = 0
    resets: int = 0

    @staticmethod
    def first_fields(run_id: str, at: float) -> dict[str, str]:
        """What a learner naming the run writes, each field only if absent."""
        return {"id": run_id, "created_at": repr(at)}

    @staticmethod
    def reset_fields(run_id: str, at: float, step: int, trained_before: int) -> dict[str, str]:
        """What a learner writes on finding the run's state lost (with ``created_at`` if absent, ``resets`` + 1)."""
        return {
            "id": run_id,
            "reset_at": repr(at),
            "reset_step": str(step),
            "trained_before_reset": str(trained_before),
        }

    @classmethod
    def from_hash(cls, h: Mapping[Any, Any]) -> RunIdentity:
        # A field this build does not know (a newer build's) is left unread: the hash outlives every process.
        d = {_text(k, "identity"): v for k, v in h.items()}
        if missing := sorted({"id", "created_at"} - d.keys()):
            raise SchemaError(f"identity: missing {missing}")
        run_id = _text(d["id"], "identity.id")
        if not 0 < len(run_id) <= 256:
            raise SchemaError(f"identity.id: length {len(run_id)} outside [1, 256]")
        if ("reset_at" in d) != ("reset_step" in d):
            raise SchemaError("identity: reset_at and reset_step go together")
        return cls(
            run_id,
            _seconds(d["created_at"], "identity.created_at"),
            _seconds(d["reset_at"], "identity.reset_at") if "reset_at" in d else None,
            _count(d["reset_step"], "identity.reset_step") if "reset_step" in d else None,
            _count(d.get("trained_before_reset", 0), "identity.trained_before_reset"),
            _count(d.get("resets", 0), "identity.resets"),
        )


# --- the learner's lease (hash ``learner:lease``: learner → learners, ``grpo status``) ----------------------------


@dataclass(frozen=True)
class LeaseHolder:
    """The learner that holds the run (learner → hash ``learner:lease``, with a TTL, → a second learner, which waits
    for it or exits, and ``grpo status``): its fencing ``token`` (it grows with every new holder), ``holder`` (the
    process's own id, unique per start), ``host``, ``pid`` and ``since`` (Redis's clock when it took the run). Written
    whole by the lease's script (common.transport.lease); ``ttl_s`` is not a field: the key's TTL, read with it."""

    token: int
    holder: str
    host: str
    pid: int
    since: float
    ttl_s: float | None = None

    def to_hash(self) -> dict[str, str]:
        return {"token": str(self.token), "holder": self.holder, "host": self.host, "pid": str(self.pid),
                "since": repr(self.since)}  # fmt: skip

    @classmethod
    def from_hash(cls, h: Mapping[Any, Any], ttl_s: float | None = None) -> LeaseHolder:
        d = {_text(k, "learner:lease"): v for k, v in h.items()}
        if missing := sorted({"token", "holder", "host", "pid", "since"} - d.keys()):
            raise SchemaError(f"learner:lease: missing {missing}")
        return cls(
            _count(d["token"], "learner:lease.token"),
            _text(d["holder"], "learner:lease.holder")[:256],
            _text(d["host"], "learner:lease.host")[:256],
            _count(d["pid"], "learner:lease.pid"),
            _seconds(d["since"], "learner:lease.since"),
            ttl_s,
        )

    def who(self) -> str:
        """The holder in words, for the line of a learner that waits for it and for ``grpo status``."""
        return f"{self.host} pid {self.pid} (lease token {self.token})"


# --- the done mark (string ``done``: learner → actors, ``grpo status``) ------------------------------------------


@dataclass(frozen=True)
class DoneMark:
    """The learner finished the run (learner → string ``done`` → actors, which exit, and ``grpo status``): Redis's
    clock when it did, in seconds. Its presence is what counts; the time is for people."""

    at: float

    def encode(self) -> str:
        return repr(self.at)

    @classmethod
    def decode(cls, raw: bytes | str) -> DoneMark:
        return cls(_seconds(raw, "done"))


# --- a dead letter (an entry of the stream ``dead``: learner or Redis → ``grpo dead``) ---------------------------

# The entry's fields, in the order the scripts write them (common.transport.dead and _delivery).
DEAD_LETTER_FIELDS = ("reason", "payload", "source_id", "at", "size", "truncated")


@dataclass(frozen=True)
class DeadLetter:
    """A message that failed to decode or validate (written by the learner's script, or by the delivery script for
    one over ``redis.max_message_bytes``; read by ``grpo dead``): the ``reason`` (one line), the raw ``payload``,
    the groups stream's ``source_id`` it had, when (``at``, the writer's clock, seconds), the message's ``size``
    in bytes, and ``truncated`` (field ``truncated`` = ``1``, absent otherwise) when the payload is only its
    first bytes. ``id`` is the entry's id in the dead stream (not a field)."""

    id: str
    reason: str
    payload: bytes
    source_id: str
    at: float
    size: int
    truncated: bool = False

    def to_fields(self) -> dict[str, bytes | str]:
        d: dict[str, bytes | str] = {"reason": self.reason, "payload": self.payload, "source_id": self.source_id,
                                     "at": repr(self.at), "size": str(self.size)}  # fmt: skip
        if self.truncated:
            d["truncated"] = "1"
        return d

    @classmethod
    def from_fields(cls, entry_id: str, fields: Mapping[Any, Any]) -> DeadLetter:
        # Fields a newer build adds are left unread (the stream outlives every process); builds before the size
        # field wrote only the first four, and their letters hold the whole message (size = the payload's).
        where = f"dead letter {entry_id}"
        d = {_text(k, where): v for k, v in fields.items()}
        if missing := sorted(set(DEAD_LETTER_FIELDS[:4]) - d.keys()):
            raise SchemaError(f"{where}: missing {missing}")
        if "truncated" in d and (flag := _text(d["truncated"], f"{where}.truncated")) != "1":
            raise SchemaError(f"{where}: truncated is {flag[:20]!r}, not 1")
        payload = d["payload"] if isinstance(d["payload"], bytes) else d["payload"].encode()
        size = _count(d.get("size", len(payload)), f"{where}.size")
        letter = cls(entry_id, _text(d["reason"], f"{where}.reason"), payload,
                     _text(d["source_id"], f"{where}.source_id"), _seconds(d["at"], f"{where}.at"), size,
                     "truncated" in d)  # fmt: skip
        if letter.size < len(payload) or (not letter.truncated and letter.size != len(payload)):
            raise SchemaError(f"dead letter {entry_id}: size {letter.size} for a payload of {len(payload)} bytes")
        return letter


# --- a round's reservation (a field of the hash ``inflight``: actor → the other actors' admission) --------------


@dataclass(frozen=True)
class Reservation:
    """Room an actor holds for a round it samples (actor → hash ``inflight``, field: the actor's id, or ``<id>/<slot>``
    for its other rounds in flight (actor/rounds.py) → every actor's admission script): ``<groups> <lease end>``,
    the round's groups and the end of the lease in milliseconds of Redis's clock. Written and read inside the
    admission scripts (common.transport.admission), whose pattern ``^(%d+) (%d+)$`` is this form's: reserving removes
    a value that does not match, as it removes an expired one (renewing one that does not match counts it as 0
    groups until then)."""

    groups: int
    lease_end_ms: int

    def encode(self) -> str:
        return f"{self.groups} {self.lease_end_ms}"

    @classmethod
    def decode(cls, raw: bytes | str) -> Reservation:
        m = re.fullmatch(r"(\d{1,19}) (\d{1,19})", _text(raw, "reservation"))
        if m is None:
            raise SchemaError(f"reservation: {as_text(raw)[:40]!r} is not '<groups> <lease end ms>'")
        return cls(int(m.group(1)), int(m.group(2)))


# --- the ``weights`` channel (learner → actors) --------------------------------------------------------------


def weights_wakeup(version: int) -> str:
    """The message published on the ``weights`` channel with each announcement: the version, in decimal. Actors
    take it only as a wake-up and read the hash ``weights:latest``, which is the truth (a message can be missed, and
    anyone may publish on the channel)."""
    return str(version)
