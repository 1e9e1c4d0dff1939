"""``grpo dead``: list the dead-letter stream, show one entry's payload, or replay entries into the groups stream.

Read (and, for a replay, written) as every operator query is (:mod:`ops.query`: whatever is running, failing fast).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from common.cli import EXIT_USAGE, role_parser
from common.config import load_config
from common.schemas import SchemaError, decode_group
from common.transport import Transport
from ops.query import asking, query_transport, unknown_run_line


def main(argv: Sequence[str]) -> int:
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
        if not asking(t, t.run_seen):
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
    total = t.dead_letter_count()
    print(f"{total} dead letters in {t.keys.dead}; groups_dead = {t.counters().dead}")
    for e in entries:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.at))
        print(f"{e.id}  {at}  {e.size:>8} B  {e.reason}")  # the message's size, not the kept prefix's
    return 0


def _show(t: Transport, entry_id: str) -> int:
    found = t.dead_letters(1, entry_id)
    if not found or found[0].id != entry_id:
        print(f"grpo dead: no entry {entry_id}", file=sys.stderr)
        return 1
    letter = found[0]
    payload = letter.payload
    print(f"reason: {letter.reason}\nsource stream id: {letter.source_id}")
    try:
        msg = decode_group(payload)
        print(f"decodes now as a group: prompt {msg.prompt_id}, version {msg.policy_version}, actor {msg.actor_id}")
    except SchemaError as e:
        print(f"does not decode: {e}")
    if letter.truncated:
        print(f"kept: the first {len(payload)} of its {letter.size} bytes (oversized: it cannot be replayed)")
    print(f"payload ({len(payload)} bytes): {payload[:4096].hex()}{'…' if len(payload) > 4096 else ''}")
    return 0


def _replay(t: Transport, ids: list[str]) -> int:
    if ids == ["all"]:
        ids = []
        start = "-"
        while batch := t.dead_letter_ids(1000, start):
            ids += batch
            start = "(" + batch[-1]
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
