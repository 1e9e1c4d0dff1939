"""Replies with which Redis refuses a command for now, before running it (part of common.transport): a full Redis
(OOM), one that cannot persist or is short of replicas, busy with a script, a replica without its primary, a Redis
Cluster that is down or moving a slot. :func:`refusal` recognises them in every form redis-py raises them;
:meth:`Connection._do <common.transport.connection.Connection._do>` waits them out, paced by :func:`refusal_pause`.
Pure: no I/O."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import redis


@dataclass(frozen=True)
class Refusal:
    """A reply with which Redis refuses a command for now, before running it: its ``code``, what Redis is in, and
    what an operator does about it."""

    code: str
    what: str
    fix: str


REFUSALS = {
    r.code: r
    for r in (
        Refusal("OOM", "Redis is full (used memory over maxmemory, maxmemory-policy noeviction) and refuses writes",
                "raise maxmemory, or find what fills it (INFO memory, redis-cli --bigkeys)"),
        Refusal("MISCONF", "Redis cannot persist (its disk is full or unwritable) and refuses writes",
                "free or fix Redis's disk (INFO persistence says what failed)"),
        Refusal("NOREPLICAS", "Redis refuses writes: fewer replicas are in sync than its min-replicas-to-write",
                "bring its replicas back, or lower min-replicas-to-write"),
        Refusal("BUSY", "Redis is busy running a script past its time limit", "wait for it, or SCRIPT KILL it"),
        Refusal("MASTERDOWN", "Redis is a replica that lost its primary (replica-serve-stale-data no)",
                "bring the primary back, or fail over"),
        Refusal("CLUSTERDOWN", "the Redis Cluster is down", "bring its nodes back"),
        Refusal("TRYAGAIN", "the Redis Cluster is moving the run's slot", "nothing: it ends once the slot has moved"),
    )
}  # fmt: skip

# Where redis-py gives a refusal a class (it strips the code from the text then); MasterDownError is a
# ClusterDownError, so it comes first. A LOADING reply is a BusyLoadingError, a ConnectionError: the reconnect
# policy's (redis.retries), not this one's.
_REFUSAL_CLASSES: tuple[tuple[type[Exception], str], ...] = (
    (redis.exceptions.OutOfMemoryError, "OOM"),
    (redis.exceptions.MasterDownError, "MASTERDOWN"),
    (redis.exceptions.ClusterDownError, "CLUSTERDOWN"),
    (redis.exceptions.TryAgainError, "TRYAGAIN"),
)
# Else the code is in the text: at its start (a code redis-py has no class for), after a pipeline's "caused error: "
# or EXECABORT's "because of: " (a transaction refused whole), or after the "-" with which Redis before 7 wraps the
# error of a command a Lua script called ("Error running script ...: @user_script: 1: -OOM command not allowed ...").
_REFUSAL_IN_TEXT = re.compile(
    r"(?:^|of pipeline caused error: |discarded because of: |@user_script: ?\d+: -)(" + "|".join(REFUSALS) + ") "
)


def refusal(error: BaseException) -> Refusal | None:
    """The refusal ``error`` is (:data:`REFUSALS`), in any of the forms redis-py raises it: a plain command's reply,
    a command queued in a transaction or a pipeline, an EXECABORT, a Lua script's error wrapping it; None for any
    other error, a lost connection included (redis-py's retry deals with those)."""
    if isinstance(error, redis.ConnectionError | redis.TimeoutError):
        return None
    for cls, code in _REFUSAL_CLASSES:
        if isinstance(error, cls):
            return REFUSALS[code]
    if not isinstance(error, redis.ResponseError):
        return None
    m = _REFUSAL_IN_TEXT.search(str(error))
    return None if m is None else REFUSALS[m.group(1)]


def refusal_pause(attempt: int, backoff_max_s: float) -> float:
    """The pause after the ``attempt``-th refused attempt at a command: 0.1 s, doubling up to ``backoff_max_s``, as
    the reconnect policy's backoff."""
    return min(backoff_max_s, 0.05 * 2.0 ** min(attempt, 64))


def refusal_attempts(wait_s: float, backoff_max_s: float) -> int:
    """How many attempts a command Redis refuses for now is given: one, and one after each pause
    (:func:`refusal_pause`) until the pauses reach ``wait_s``."""
    attempts, waited = 1, 0.0
    while waited < wait_s - 1e-9:
        pause = refusal_pause(attempts, backoff_max_s)
        if pause >= backoff_max_s:  # every pause from here is the longest
            return attempts + math.ceil((wait_s - waited) / backoff_max_s - 1e-9)
        waited += pause
        attempts += 1
    return attempts
