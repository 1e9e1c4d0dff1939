"""The wire package's small forms (see common.schemas, its face): the weights announcement, an actor's heartbeat, and
the values of weights over NCCL (a member's registration, a round, the learner's decision on it). Each has one
encoding, and a decoder that validates it strictly: anything malformed is one SchemaError with a one-line reason."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, cast

from common.schemas.fields import SchemaError, as_text, integer, json_map, keys_of, number, text

# The digests a version may be announced with, and the length of each one's hex form.
DIGEST_HEX_LENGTHS = {"xxh3-128": 32, "sha256": 64}
# How an announced version is delivered: a directory of safetensors files, over the NCCL update group, or a LoRA
# adapter's directory (learner.lora; common.model.lora) that the actors apply to the base model they hold.
WEIGHTS_FORMATS = ("hf-safetensors", "nccl", "lora-safetensors")


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


def _string(v: Any, where: str, most: int = 4096, allow_empty: bool = False) -> str:
    """A string of at most ``most`` characters (names that may be longer than an id: tensors, groups, hosts)."""
    if not isinstance(v, str):
        raise SchemaError(f"{where}: expected a string, got {type(v).__name__}")
    if (not v and not allow_empty) or len(v) > most or "\x00" in v:
        raise SchemaError(f"{where}: length {len(v)} outside [1, {most}] (or a NUL)")
    return v


def _list(v: Any, where: str, most: int = 1 << 20) -> list[Any]:
    if not isinstance(v, list) or len(v) > most:
        raise SchemaError(f"{where}: expected a list of at most {most} items")
    return v


# --- actors' heartbeats ----------------------------------------------------------------------------------------

_HEARTBEAT_COUNTS = ("version", "groups_sent", "rounds")


@dataclass(frozen=True)
class Heartbeat:
    """An actor is alive (actor → string ``actors:<id>``, whose TTL is the actor's life → ``grpo status``, ``grpo
    run``'s view, the learner). JSON ``{"pid", "at", "version", "groups_sent", "rounds"}``: its process id, its
    machine's time of the beat, the policy version its engine serves (−1: none loaded yet), the groups it sent and the
    rounds it sampled; the last three optional (present in every beat of an actor of this build)."""

    pid: int
    at: float
    version: int | None = None
    groups_sent: int | None = None
    rounds: int | None = None

    def fields(self) -> dict[str, Any]:
        """The JSON object: ``pid``, ``at``, then the counts that are present."""
        d: dict[str, Any] = {"pid": self.pid, "at": self.at}
        d.update({k: v for k in _HEARTBEAT_COUNTS if (v := getattr(self, k)) is not None})
        return d

    def encode(self) -> str:
        return json.dumps(self.fields())

    @classmethod
    def decode(cls, raw: bytes | str) -> Heartbeat:
        d = json_map(raw, "heartbeat")
        if missing := sorted({"pid", "at"} - d.keys()):
            raise SchemaError(f"heartbeat: missing {missing}")
        if extra := sorted(d.keys() - {"pid", "at", *_HEARTBEAT_COUNTS}):
            raise SchemaError(f"heartbeat: unknown keys {extra}")
        counts = {k: integer(d[k], f"heartbeat.{k}", -1 if k == "version" else 0) for k in _HEARTBEAT_COUNTS if k in d}
        return cls(integer(d["pid"], "heartbeat.pid"), number(d["at"], "heartbeat.at", 0.0), **counts)


# --- weights over NCCL (common.weights.nccl has the protocol) ---------------------------------------------------


@dataclass(frozen=True)
class NcclMember:
    """An actor whose engine can take weights over NCCL (actor → hash ``nccl:members``, field: the actor's id →
    learner), registered again with every heartbeat. JSON ``{"ranks", "nonce", "group", "at"}``: its server's ranks
    (≥ 1), a nonce of its process (a restarted actor is a new member), the update group it is in (null: none), and
    Redis's clock at the registration (so that a machine's skewed clock cannot age it out)."""

    ranks: int
    nonce: str = ""
    group: str | None = None
    at: float = 0.0

    def fields(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "nonce": self.nonce, "group": self.group, "at": self.at}

    def encode(self) -> str:
        return json.dumps(self.fields())

    @classmethod
    def decode(cls, raw: bytes | str) -> NcclMember:
        d = keys_of(json_map(raw, "nccl member"), "nccl member", {"ranks", "nonce", "group", "at"})
        group = d["group"]
        return cls(
            integer(d["ranks"], "nccl member.ranks", 1, 1 << 20),
            _string(d["nonce"], "nccl member.nonce", 256, allow_empty=True),
            None if group is None else _string(group, "nccl member.group"),
            number(d["at"], "nccl member.at", 0.0),
        )


# dtype names as SGLang reads them (``getattr(torch, name)``), and the bytes of one element of each.
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
               "uint8": 1, "bool": 1}  # fmt: skip
DTYPES = tuple(DTYPE_SIZES)


@dataclass(frozen=True)
class Bucket:
    """Tensors broadcast as one flattened bucket (part of a :class:`NcclRound`): their names, dtypes and shapes, in the
    order their bytes follow each other."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]

    def sizes(self) -> list[int]:
        """Bytes of each tensor, in order."""
        return [math.prod(s) * DTYPE_SIZES[d] for s, d in zip(self.shapes, self.dtypes, strict=True)]

    @property
    def nbytes(self) -> int:
        return sum(self.sizes())

    @classmethod
    def from_fields(cls, v: Any, where: str) -> Bucket:
        d = keys_of(v, where, {"names", "dtypes", "shapes"})
        names = [_string(n, f"{where}.names") for n in _list(d["names"], f"{where}.names")]
        dtypes = _list(d["dtypes"], f"{where}.dtypes")
        if bad := [x for x in dtypes if not isinstance(x, str) or x not in DTYPE_SIZES]:
            raise SchemaError(f"{where}.dtypes: {str(bad[0])[:40]!r} not one of {list(DTYPES)}")
        shapes = [
            [integer(n, f"{where}.shapes") for n in _list(s, f"{where}.shapes", 64)]
            for s in _list(d["shapes"], f"{where}.shapes")
        ]
        if not len(names) == len(dtypes) == len(shapes):
            raise SchemaError(f"{where}: {len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes")
        return cls(names, dtypes, shapes)


_ROUND_KEYS = {"session", "seq", "version", "group", "address", "port", "world_size", "backend", "ranks", "buckets"}


@dataclass(frozen=True)
class NcclRound:
    """One version on its way (learner → string ``nccl:round`` → every member), as compact JSON of its fields."""

    session: str  # the learner process's: rounds of another learner (a restarted one) are never mistaken for ours
    seq: int  # increases with every round of the session
    version: int
    group: str  # the update group's name; a new name means a new group that members join when told to
    address: str
    port: int
    world_size: int
    backend: str
    ranks: dict[str, int]  # member id -> its rank offset (the learner is rank 0)
    buckets: list[Bucket] = field(default_factory=list)

    @property
    def id(self) -> str:
        """``<session>:<seq>``: what members say they are ready for, and what a decision names."""
        return f"{self.session}:{self.seq}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> NcclRound:
        """The round's JSON → a validated NcclRound, or SchemaError with a one-line reason."""
        d = json_map(raw, "nccl round")
        d = keys_of(d if "buckets" in d else {**d, "buckets": []}, "nccl round", _ROUND_KEYS)
        if not isinstance(ranks := d["ranks"], dict):
            raise SchemaError("nccl round.ranks: expected a map of member id -> rank offset")
        return cls(
            _string(d["session"], "nccl round.session", 256),
            integer(d["seq"], "nccl round.seq"),
            integer(d["version"], "nccl round.version"),
            _string(d["group"], "nccl round.group"),
            _string(d["address"], "nccl round.address", 1024),
            integer(d["port"], "nccl round.port", 0, 65535),
            integer(d["world_size"], "nccl round.world_size", 1, 1 << 20),
            _string(d["backend"], "nccl round.backend", 64),
            {text(k, "nccl round.ranks"): integer(v, f"nccl round.ranks.{k}", 1) for k, v in ranks.items()},
            [Bucket.from_fields(b, f"nccl round.buckets[{i}]") for i, b in enumerate(_list(d["buckets"], "buckets"))],
        )


NcclDecisionName = Literal["join", "go", "cancel"]
_DECISIONS = ("join", "go", "cancel")


@dataclass(frozen=True)
class NcclDecision:
    """The learner's decision on a round (learner → string ``nccl:state`` → members): ``<round id>:<decision>``,
    the round id being :attr:`NcclRound.id`. ``join``: members join the round's new group; ``go``: the learner
    broadcasts now; ``cancel``: it does not (the version goes to disk)."""

    round_id: str
    decision: NcclDecisionName

    def __post_init__(self) -> None:
        if self.decision not in _DECISIONS or not self.round_id:
            raise SchemaError(f"nccl decision: {self.decision[:40]!r} on round {self.round_id[:80]!r} is not one of "
                              f"{list(_DECISIONS)} on a round id")  # fmt: skip

    def encode(self) -> str:
        return f"{self.round_id}:{self.decision}"

    @classmethod
    def decode(cls, raw: bytes | str) -> NcclDecision:
        try:
            round_id, _, decision = as_text(raw).rpartition(":")
        except UnicodeDecodeError:
            raise SchemaError("nccl decision: not UTF-8 text") from None
        return cls(round_id, cast(NcclDecisionName, decision))
