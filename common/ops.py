"""Operator commands that read (and, for replay, write) a run's keys in Redis, whatever is running.

``grpo status``: the accounting equation, live actors, the published version and whether the run is done.
``grpo dead``: list the dead-letter stream, show one entry's payload, or replay entries into the groups stream.

Both take the same ``--config FILE`` and ``-o key=value`` as the roles, so ``redis.*`` and ``run.name`` (or
``GRPO_REDIS_URL`` / ``GRPO_RUN_NAME``) pick the run. Unlike the roles they fail fast: a query connects once, with a
short timeout, and an unreachable Redis or a run name Redis has never seen is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import redis

from common.cli import EXIT_USAGE, role_parser
from common.config import Config, load_config, mask_url
from common.schemas import SchemaError, WeightsAnnouncement, as_text, decode_group
from common.transport import Transport, TransportError, read_balance

T = TypeVar("T")

# A query waits this long at most for a connection or a reply. Services retry with backoff (redis.retries) because
# they must outlive a Redis restart; an operator asking a question wants the answer, or the reason there is none, now.
QUERY_TIMEOUT_S = 3.0
_KNOWN_RUNS_SHOWN = 10
_SCAN_CALLS = 50  # at most this many SCAN calls (of 1000 keys) to name the runs Redis knows: a hint, not an inventory


def query_transport(cfg: Config) -> Transport:
    """A connection for one question: no reconnect attempts, a short timeout, and its one failure reported as the
    one line (the transport's ``attempt i/n`` warnings belong to services that retry)."""
    logging.getLogger("common.transport").setLevel(logging.ERROR)
    timeout = min(cfg.redis.socket_timeout_s, QUERY_TIMEOUT_S)
    t = Transport(cfg.redis.model_copy(update={"retries": 0, "socket_timeout_s": timeout}), cfg.run.name)
    try:
        t.ping()  # TransportError: "redis at <masked url> is unreachable: ...", exit 2
    except BaseException:
        t.close()
        raise
    return t


def asking(t: Transport, fn: Callable[[], T]) -> T:
    """``fn()``, with a connection lost mid-question said like one that was never there (no retries here)."""
    try:
        return fn()
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise TransportError(f"redis at {t.safe_url} is unreachable: {e}") from None


def run_exists(t: Transport) -> bool:
    """Whether Redis holds any key of this run: its identity (a learner started), counters or stream (an actor
    sent groups), the prompt cursor or a reserved round (an actor is sampling its first), dead letters, an
    announcement or the done mark. One EXISTS: the keys share one slot."""
    k = t.keys
    keys = (k.identity, k.stats, k.groups, k.prompts_cursor, k.inflight, k.dead, k.weights_latest, k.done, k.filtered)
    return bool(t._do(lambda: t.client.exists(*keys)))


def known_runs(t: Transport) -> list[str] | None:
    """Run names with keys in this Redis (sorted; a bounded SCAN), or None when this user may not list keys."""
    names: set[str] = set()
    cursor = 0
    try:
        for _ in range(_SCAN_CALLS):
            cursor, found = t.client.scan(cursor, match="grpo:{*}:*", count=1000)
            names.update(m.group(1) for key in found if (m := re.match(r"grpo:\{(.*?)\}:", as_text(key))))
            if cursor == 0:
                break
    except redis.ResponseError:  # an ACL user limited to its run's keys may not SCAN: the hint is left out
        return None
    return sorted(names)


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


def counts(d: Mapping[str, int]) -> str:
    """``{'stale': 41, 'nonfinite': 2}`` → ``43 (stale 41, nonfinite 2)``; ``{}`` → ``0``: counts by reason in words."""
    total = sum(d.values())
    return f"{total} ({', '.join(f'{k} {v}' for k, v in sorted(d.items()))})" if d else "0"


def _yes(flag: object) -> str:
    return "yes" if flag else "no"


def status_main(argv: Sequence[str]) -> int:
    p = role_parser("grpo status", "The accounting equation and the state of a run, read from Redis.")
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = p.parse_args(list(argv))
    cfg = load_config(args.config, args.override)
    t = query_transport(cfg)
    try:
        report = asking(t, lambda: _report(cfg, t))
        if report is None:
            print(asking(t, lambda: unknown_run_line("grpo status", cfg, t)), file=sys.stderr)
            return EXIT_USAGE
    finally:
        t.close()
    if args.json:
        print(json.dumps(report))
    else:
        print_status(cfg.run.name, report)
    return 0 if report["unexplained"] == 0 and not report["lost"] else 1


def _report(cfg: Config, t: Transport) -> dict[str, Any] | None:
    """What ``grpo status`` reports, or None for a run Redis has never seen (and no checkpoint here shows)."""
    b = read_balance(t)
    lost = lost_state(cfg, t, b.trained)
    if not lost and not run_exists(t):
        return None
    ann, weights_problem = _announced(t)
    actors = t.live_actors()
    return {
        "run": t.keys.prefix,
        # Balanced counts in a Redis that lost the run's state are not the run's accounting: never "balanced".
        "equation": b.equation().replace("(balanced)", "(balanced since the loss)" if lost else "(balanced)"),
        "produced": b.produced,
        "trained": b.trained,
        "dropped": b.dropped,
        "dead": b.dead,
        "pending": b.pending,
        "unread": b.unread,
        "filtered": b.filtered,
        "discarded": b.discarded,
        "unexplained": b.unexplained,
        "lost": lost,  # what Redis no longer holds of the run (empty: the counts are the whole run's)
        "published_version": None if ann is None else ann.version,
        "weights_malformed": weights_problem,
        "done": t.is_done(),
        "actors": {k: v.get("version") for k, v in sorted(actors.items())},
    }


def print_status(name: str, r: Mapping[str, Any]) -> None:
    """The report as lines of words (``--json`` keeps the dicts)."""
    version = r["published_version"]
    published = "none yet" if version is None else str(version)
    print(f"run {name} (keys {r['run']}*)  published version {published}  learner finished: {_yes(r['done'])}")
    if r["weights_malformed"]:
        print(f"weights:latest is malformed, actors ignore it until the learner's next announcement: "
              f"{r['weights_malformed']}")  # fmt: skip
    print(r["equation"])
    for line in r["lost"]:
        print(f"NOT WHOLE: {line}")
    print(f"dropped {counts(r['dropped'])}  filtered by actors {counts(r['filtered'])}  "
          f"discarded {counts(r['discarded'])}")  # fmt: skip
    actors: Mapping[str, int | None] = r["actors"]
    if not actors:
        print("no live actors")
        return
    each = ", ".join(f"{k} ({'no weights yet' if v is None or v == -1 else f'v{v}'})" for k, v in actors.items())
    print(f"{len(actors)} live actor{'s' if len(actors) != 1 else ''}: {each}")


def lost_state(cfg: Config, t: Transport, trained: int) -> list[str]:
    """What Redis no longer knows of this run, in words (empty when it holds the whole run): a loss the learner
    recorded in the run's identity, and, where this machine sees the run's checkpoints, a run they show trained
    that Redis holds nothing of, another run's identity, or fewer trained groups than they show."""
    identity = t.identity()
    lost = []
    before = int(identity.get("trained_before_reset", 0))
    if "reset_at" in identity:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(identity["reset_at"])))
        lost.append(f"Redis lost this run's state at {when} (learner step {identity.get('reset_step')}, "
                    f"{identity.get('resets')} time(s)): {before} groups trained before are not in these "
                    "counts")  # fmt: skip
    found = _newest_checkpoint(Path(cfg.checkpoint.dir))
    if found is None:
        return lost
    path, state = found
    run_id, step = state.get("run_id"), state.get("step")
    shown = int(state.get("counters", {}).get("groups_consumed", 0))
    if run_id and "id" not in identity:
        lost.append(f"Redis holds nothing of run {run_id}, which {path} shows trained to step {step} ({shown} "
                    f"groups): it lost the run's state (the learner records it when it next starts)")  # fmt: skip
    elif run_id and identity["id"] != run_id:
        lost.append(f"Redis holds run {identity['id']} under this run.name, not run {run_id} of {path}")
    # The groups a checkpoint covers are acknowledged (counted trained in Redis) only once it is on disk: in between
    # Redis rightly counts fewer.
    elif trained < shown - before - len(state.get("covers", [])):
        lost.append(f"Redis counts {trained} groups trained where {path} shows {shown - before}: it lost part of "
                    f"this run's state (restored from an older copy?)")  # fmt: skip
    return lost


def _newest_checkpoint(root: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint's ``state.json`` that parses (read only: status never touches the run directory)."""
    steps = sorted((p for p in root.glob("step-*") if re.fullmatch(r"step-\d{6,}", p.name)), reverse=True)
    for path in steps:
        try:
            state = json.loads((path / "state.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(state, dict):
            return path, state
    return None


def _announced(t: Transport) -> tuple[WeightsAnnouncement | None, str | None]:
    """The announced weights, or why ``weights:latest`` cannot be read (reported, not a traceback)."""
    try:
        return t.latest_weights(), None
    except SchemaError as e:
        return None, str(e)


def dead_main(argv: Sequence[str]) -> int:
    p = role_parser("grpo dead", "Read and replay the dead-letter stream (malformed messages, with their reason).")
    p.add_argument("--limit", type=int, default=20, help="entries to list (oldest first)")
    p.add_argument("--from", dest="start", default="-", metavar="ID", help="list from this entry id")
    p.add_argument("--show", metavar="ID", help="print one entry's reason and its payload as hex (or decoded)")
    p.add_argument(
        "--replay",
        nargs="+",
        metavar="ID",
        help="put these entries back into the groups stream (after fixing what rejected them, e.g. the learner's "
        "model); 'all' replays every entry",
    )
    args = p.parse_args(list(argv))
    cfg = load_config(args.config, args.override)
    t = query_transport(cfg)
    try:
        if not asking(t, lambda: run_exists(t)):
            print(asking(t, lambda: unknown_run_line("grpo dead", cfg, t)), file=sys.stderr)
            return EXIT_USAGE
        return asking(t, lambda: _dead(t, args))
    finally:
        t.close()


def _dead(t: Transport, args: argparse.Namespace) -> int:
    if args.replay:
        return _replay(t, args.replay)
    if args.show:
        return _show(t, args.show)
    entries = t.dead_letters(args.limit, args.start)
    total = t._do(lambda: t.client.xlen(t.keys.dead))
    print(f"{total} dead letters in {t.keys.dead}; groups_dead = {t.stats().get('groups_dead', 0)}")
    for e in entries:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(as_text(e.fields.get(b"at", b"0")))))
        size = int(e.fields.get(b"size") or len(e.fields.get(b"payload", b"")))  # the message's, not the prefix's
        print(f"{e.id}  {at}  {size:>8} B  {as_text(e.fields.get(b'reason', b''))}")
    return 0


def _show(t: Transport, entry_id: str) -> int:
    found = t.dead_letters(1, entry_id)
    if not found or found[0].id != entry_id:
        print(f"grpo dead: no entry {entry_id}", file=sys.stderr)
        return 1
    f = found[0].fields
    payload = f.get(b"payload", b"")
    print(f"reason: {as_text(f.get(b'reason', b''))}\nsource stream id: {as_text(f.get(b'source_id', b''))}")
    try:
        msg = decode_group(payload)
        print(f"decodes now as a group: prompt {msg.prompt_id}, version {msg.policy_version}, actor {msg.actor_id}")
    except SchemaError as e:
        print(f"does not decode: {e}")
    if f.get(b"truncated") == b"1":
        size = as_text(f.get(b"size", b"?"))
        print(f"kept: the first {len(payload)} of its {size} bytes (oversized: it cannot be replayed)")
    print(f"payload ({len(payload)} bytes): {payload[:4096].hex()}{'…' if len(payload) > 4096 else ''}")
    return 0


def _replay(t: Transport, ids: list[str]) -> int:
    if ids == ["all"]:
        ids = []
        start = "-"
        while batch := t.dead_letters(1000, start):
            ids += [e.id for e in batch]
            start = "(" + batch[-1].id
    missing = 0
    for entry_id in ids:
        try:
            new = t.replay_dead(entry_id)
        except ValueError as e:  # a truncated (oversized) letter: it stays in the dead stream
            missing += 1
            print(f"{entry_id}: {e}", file=sys.stderr)
            continue
        if new is None:
            missing += 1
            print(f"{entry_id}: no such dead letter", file=sys.stderr)
        else:
            print(f"{entry_id} -> groups {new}")
    print(f"replayed {len(ids) - missing} of {len(ids)}")
    return 0 if missing == 0 else 1
