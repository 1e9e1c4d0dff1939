"""Who is there (part of common.transport): actors' heartbeats, and the members and rounds of weights over NCCL
(the protocol is common.weights.nccl's). Every value is one of the wire package's forms (common.schemas)."""

from __future__ import annotations

import os
import time
from typing import Any, cast

from common.schemas import Heartbeat, NcclDecision, NcclDecisionName, NcclMember, NcclRound, SchemaError, as_text
from common.transport.connection import Connection
from common.transport.lease import Fenced, Leasing

# Remove a hash field only if it still holds the value read: a member that re-registered meanwhile stays.
_HDEL_IF = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""


class Member(Connection):
    """The actor's side: its heartbeat, and its part in the rounds of weights over NCCL."""

    def heartbeat(self, actor_id: str, ttl_s: float, info: dict[str, Any]) -> None:
        """``actor_id`` is alive for ``ttl_s``: a :class:`~common.schemas.Heartbeat` of this process, with ``info``
        (``version``, ``groups_sent``, ``rounds``)."""
        body = Heartbeat(os.getpid(), time.time(), **info).encode()
        self._do(lambda: self.client.set(self.keys.actor(actor_id), body, px=max(1, int(ttl_s * 1000))))

    def heartbeat_left_s(self, actor_id: str) -> float | None:
        """How long ``actor_id``'s heartbeat key has left to live, or None where there is none (no process beats under
        that id, or the last one's lapsed)."""
        ms = int(self._do(lambda: self.client.pttl(self.keys.actor(actor_id))))
        return None if ms == -2 else max(ms, 0) / 1000  # (-1, a key without a TTL: set by hand, alive)

    def nccl_register(self, member: str, info: dict[str, Any]) -> None:
        """An actor whose engine can take weights over NCCL says so (again every heartbeat and whenever it joins or
        leaves a group): ``info`` holds its server's ``ranks``, a ``nonce`` of its process and the ``group`` it is
        in. Stamped with Redis's clock, so that a machine's skewed clock cannot age it out."""
        body = NcclMember(**info, at=self.server_time()).encode()
        self._do(lambda: self.client.hset(self.keys.nccl_members, member, body))

    def nccl_unregister(self, member: str) -> None:
        self._do(lambda: self.client.hdel(self.keys.nccl_members, member))

    def nccl_round(self) -> NcclRound | None:
        """The current round; None when there is none; SchemaError (one line) when it is malformed."""
        raw = cast("bytes | None", self._do(lambda: self.client.get(self.keys.nccl_round)))
        return None if raw is None else NcclRound.from_json(raw)

    def nccl_ready(self, round_id: str, member: str) -> None:
        """``round_id``: the learner's session and the round's sequence number, ``<session>:<seq>``."""
        self._do(lambda: self.client.hset(self.keys.nccl_ready, member, round_id))

    def nccl_decision(self, round_id: str) -> NcclDecisionName | None:
        """The decision on round ``round_id``; ``cancel`` once the state belongs to any other round (a later one, or
        another learner's) or the round is unreadable, None while undecided."""
        value, state = self._do(lambda: self.client.mget(self.keys.nccl_round, self.keys.nccl_state))
        decided = _decision(state)
        if decided is not None and decided.round_id == round_id:
            return decided.decision
        if value is None:
            return "cancel"
        try:
            current = NcclRound.from_json(value).id
        except SchemaError:
            return "cancel"
        return None if current == round_id else "cancel"


class Fleet(Leasing):
    """The learner's side: which actors are alive, and the rounds of weights over NCCL it opens and decides, behind
    its fence."""

    _hdel_if_script = Fenced(_HDEL_IF)  # stale members pruned behind the fence

    def live_actors(self) -> dict[str, Heartbeat]:
        """Heartbeats of the actors whose key has not expired, by actor id; SchemaError when one is malformed."""
        keys = self._do(lambda: list(self.client.scan_iter(match=self.keys.actor("*"), count=100)))
        values = self._do(lambda: self.client.mget(keys)) if keys else []
        return {
            as_text(k).rsplit(":", 1)[-1]: Heartbeat.decode(v)
            for k, v in zip(keys, values, strict=True)
            if v is not None
        }

    def nccl_members(self, max_age_s: float) -> dict[str, NcclMember]:
        """Members registered in the last ``max_age_s``, by id; older or malformed entries (an actor killed before
        it could unregister) are removed, unless re-registered meanwhile."""
        now = self.server_time()
        members: dict[str, NcclMember] = {}
        for k, v in self._do(lambda: self.client.hgetall(self.keys.nccl_members)).items():
            member = _member(v)
            if member is not None and now - member.at <= max_age_s:
                members[as_text(k)] = member
            else:
                self._hdel_if(self.keys.nccl_members, k, v)
        return members

    def _hdel_if(self, key: str, field: Any, value: Any) -> None:
        self._hdel_if_script(keys=[key], args=[field, value])

    def nccl_open_round(self, nccl_round: NcclRound) -> None:
        """Start a round: its description, no one ready yet, no decision (members poll for it)."""
        k = self.keys
        self.write(("DEL", k.nccl_ready), ("DEL", k.nccl_state), ("SET", k.nccl_round, nccl_round.to_json()))

    def nccl_ready_members(self, round_id: str) -> set[str]:
        ready = self._do(lambda: self.client.hgetall(self.keys.nccl_ready))
        return {as_text(k) for k, v in ready.items() if as_text(v) == round_id}

    def nccl_decide(self, round_id: str, decision: NcclDecisionName) -> None:
        """``join`` (members join the round's new group), ``go`` (the learner broadcasts now) or ``cancel`` (it does
        not: the version goes to disk)."""
        self.write(("SET", self.keys.nccl_state, NcclDecision(round_id, decision).encode()))


def _member(raw: bytes | str) -> NcclMember | None:
    try:
        return NcclMember.decode(raw)
    except SchemaError:
        return None


def _decision(raw: bytes | str | None) -> NcclDecision | None:
    """The decision in ``nccl:state``; None when there is none, or it is unreadable (then no round is decided)."""
    try:
        return None if raw is None else NcclDecision.decode(raw)
    except SchemaError:
        return None
