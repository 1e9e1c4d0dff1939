"""A question to a run's Redis, as ``grpo status`` and ``grpo dead`` ask it: whatever is running, and failing fast.

Both take the same ``--config FILE`` and ``-o key=value`` as the roles, so ``redis.*`` and ``run.name`` (or
``GRPO_REDIS_URL`` / ``GRPO_RUN_NAME``) pick the run. Unlike the roles they fail fast: a query connects once, with a
short timeout, and an unreachable Redis, a run name Redis has never seen, or a value of the run this build cannot read
(a counter that is not a count, a dead letter without its fields) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import redis

from common.config import Config, mask_url
from common.schemas import SchemaError
from common.transport import Transport, TransportError

T = TypeVar("T")

# A query waits this long at most for a connection or a reply. Services retry with backoff (redis.retries) because
# they must outlive a Redis restart; an operator asking a question wants the answer, or the reason there is none, now.
QUERY_TIMEOUT_S = 3.0
_KNOWN_RUNS_SHOWN = 10
_SCAN_CALLS = 50  # at most this many SCAN calls (of 1000 keys) to name the runs Redis knows: a hint, not an inventory


def query_transport(cfg: Config) -> Transport:
    """A connection for one question: no reconnect attempts, a short timeout, no wait for a Redis that refuses
    commands for now (busy with a script, loading its data: ``redis.full_wait_s`` is for services, which must ride
    it out; an operator's question is answered at once), and its one failure reported as the one line (the
    transport's ``attempt i/n`` warnings belong to services that retry)."""
    logging.getLogger("common.transport").setLevel(logging.ERROR)
    timeout = min(cfg.redis.socket_timeout_s, QUERY_TIMEOUT_S)
    now = {"retries": 0, "socket_timeout_s": timeout, "full_wait_s": 0.0}
    t = Transport(cfg.redis.model_copy(update=now), cfg.run.name)
    try:
        t.ping()  # TransportError: "redis at <masked url> is unreachable: ...", exit 2
    except BaseException:
        t.close()
        raise
    return t


def asking(t: Transport, fn: Callable[[], T]) -> T:
    """``fn()``, with a connection lost mid-question said like one that was never there (no retries here), and a
    malformed value of the run as one line too."""
    try:
        return fn()
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise TransportError(f"redis at {t.safe_url} is unreachable: {e}") from None
    except SchemaError as e:  # a value of the run this build cannot read: said in one line, not a traceback
        raise TransportError(f"redis at {t.safe_url} holds a malformed value of run {t.keys.prefix}*: {e}") from None


def known_runs(t: Transport) -> list[str] | None:
    """Run names with keys in this Redis (sorted; a bounded SCAN), or None when this user may not list keys."""
    try:
        return t.run_names(_SCAN_CALLS)
    except redis.ResponseError:  # an ACL user limited to its run's keys may not SCAN: the hint is left out
        return None


def unknown_run_line(prog: str, cfg: Config, t: Transport) -> str:
    """The one line for a run name Redis has never seen: a mistaken ``run.name`` (or the wrong Redis)."""
    runs = known_runs(t)
    if runs is None:
        hint = ""
    elif not runs:
        hint = " (it holds no run at all)"
    else:
        more = f", and {len(runs) - _KNOWN_RUNS_SHOWN} more" if len(runs) > _KNOWN_RUNS_SHOWN else ""
        hint = f" (runs it knows: {', '.join(runs[:_KNOWN_RUNS_SHOWN])}{more})"
    return (f"{prog}: Redis at {mask_url(cfg.redis.url)} has no run named {cfg.run.name!r}{hint}; "
            f"set run.name (-o run.name=NAME or GRPO_RUN_NAME)")  # fmt: skip
