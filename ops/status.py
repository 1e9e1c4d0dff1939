"""``grpo status``: the accounting equations (the groups', and the prompts' beside it), live actors, the published
version and whether the run is done.

Read from Redis as every operator query is (:mod:`ops.query`: whatever is running, failing fast). Exit codes: 0 when
the counts balance and are the whole run, 1 when something is unexplained or Redis lost part of the run, 2 when Redis
is unreachable, refuses the password, knows no run of that name, or holds a value of the run this build cannot read.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from common.cli import EXIT_USAGE, role_parser
from common.config import Config, load_config
from common.schemas import LeaseHolder, SchemaError, WeightsAnnouncement
from common.transport import PromptBalance, Transport, choices_of, lease_line, read_balance
from ops.query import asking, query_transport, unknown_run_line


def counts(d: Mapping[str, int]) -> str:
    """``{'stale': 41, 'nonfinite': 2}`` → ``43 (stale 41, nonfinite 2)``; ``{}`` → ``0``: counts by reason in words."""
    total = sum(d.values())
    return f"{total} ({', '.join(f'{k} {v}' for k, v in sorted(d.items()))})" if d else "0"


def _yes(flag: object) -> str:
    return "yes" if flag else "no"


def main(argv: Sequence[str]) -> int:
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
    whole = report["unexplained"] == 0 and report["prompt_positions"]["unexplained"] == 0
    return 0 if whole and not report["lost"] else 1


def _report(cfg: Config, t: Transport) -> dict[str, Any] | None:
    """What ``grpo status`` reports, or None for a run Redis has never seen (and no checkpoint here shows)."""
    b = read_balance(t)
    pb = t.prompt_balance()
    lost = lost_state(cfg, t, b.trained)
    if not lost and not t.run_seen():
        return None
    ann, weights_problem = _announced(t)
    actors = t.live_actors()
    holder, lease_problem = _holder(t)
    on_record, choices = t.sampling_choices()
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
        "actors": {k: v.version for k, v in sorted(actors.items())},
        # The learner that holds the run (learner:lease): None when none does (finished, stopped, or dead past its
        # lease); a malformed hash is said in words, as weights:latest's is.
        "learner": None if holder is None else {**asdict(holder), "line": lease_line(holder)},
        "learner_lease_malformed": lease_problem,
        # Difficulty sampling (prompts:record, prompts:choices): problems on record, positions taken / passed over.
        "prompts": {"on_record": on_record, "choices": choices},
        # What became of every prompt position drawn (common.schemas.prompts), beside the groups' equation.
        "prompt_positions": prompt_report(pb, lost),
    }


def prompt_report(pb: PromptBalance, lost: list[str]) -> dict[str, Any]:
    c = pb.counters
    equation = pb.equation() if c.counted else "prompts: not counted (the actors of this run are of an earlier build)"
    return {
        "equation": equation.replace("(balanced)", "(balanced since the loss)" if lost else "(balanced)"),
        "drawn": c.drawn,
        "sent": c.sent,
        "filtered": c.filtered,
        "discarded": c.discarded,
        "skipped": c.skipped,
        "in_flight": pb.claimed,
        "held_by_actors_gone": pb.expired,
        "to_redraw": pb.to_redraw,
        "requeued": c.requeued,
        "redrawn": c.redrawn,
        "trained": c.trained,
        "retrained": c.retrained,
        "unexplained": pb.unexplained if c.counted else 0,
    }


def print_status(name: str, r: Mapping[str, Any]) -> None:
    """The report as lines of words (``--json`` keeps the dicts)."""
    version = r["published_version"]
    published = "none yet" if version is None else str(version)
    print(f"run {name} (keys {r['run']}*)  published version {published}  learner finished: {_yes(r['done'])}")
    if r["weights_malformed"]:
        print(f"weights:latest is malformed, actors ignore it until the learner's next announcement: "
              f"{r['weights_malformed']}")  # fmt: skip
    print(
        f"learner: {r['learner']['line'] if r['learner'] else lease_line(None)}"
        + (f" (learner:lease is malformed: {r['learner_lease_malformed']})" if r["learner_lease_malformed"] else "")
    )
    print(r["equation"])
    for line in r["lost"]:
        print(f"NOT WHOLE: {line}")
    print(f"dropped {counts(r['dropped'])}  filtered by actors {counts(r['filtered'])}  "
          f"discarded {counts(r['discarded'])}")  # fmt: skip
    for line in prompt_lines(r["prompt_positions"]):
        print(line)
    if line := sampling_line(r["prompts"]):
        print(line)
    actors: Mapping[str, int | None] = r["actors"]
    if not actors:
        print("no live actors")
        return
    each = ", ".join(f"{k} ({'no weights yet' if v is None or v == -1 else f'v{v}'})" for k, v in actors.items())
    print(f"{len(actors)} live actor{'s' if len(actors) != 1 else ''}: {each}")


def prompt_lines(p: Mapping[str, Any]) -> list[str]:
    """The prompts' equation, and where the positions given back and the trained ones went."""
    if not p["drawn"] and not p["redrawn"]:
        return [p["equation"]]
    twice = "none twice" if not p["retrained"] else f"{p['retrained']} TWICE in a pass"
    return [
        p["equation"],
        f"prompt positions given back {counts(p['requeued'])}, drawn again {p['redrawn']}; filtered "
        f"{counts(p['filtered'])}, discarded {counts(p['discarded'])}, skipped {counts(p['skipped'])}; "
        f"trained {p['trained']} ({twice})",
    ]


def sampling_line(prompts: Mapping[str, Any]) -> str:
    """What difficulty sampling chose, by the problems' pools; empty for a run that draws by the cursor."""
    choices: Mapping[str, int] = prompts["choices"]
    if not prompts["on_record"] and not choices:
        return ""
    return (f"difficulty sampling: {prompts['on_record']} problems on record; positions taken "
            f"{counts(choices_of('taken', choices))}, passed over {counts(choices_of('passed', choices))}")  # fmt: skip


def lost_state(cfg: Config, t: Transport, trained: int) -> list[str]:
    """What Redis no longer knows of this run, in words (empty when it holds the whole run): a loss the learner
    recorded in the run's identity, and, where this machine sees the run's checkpoints, a run they show trained
    that Redis holds nothing of, another run's identity, or fewer trained groups than they show."""
    identity = t.identity()
    lost = []
    before = identity.trained_before_reset if identity is not None else 0
    if identity is not None and identity.reset_at is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(identity.reset_at))
        lost.append(f"Redis lost this run's state at {when} (learner step {identity.reset_step}, "
                    f"{identity.resets} time(s)): {before} groups trained before are not in these "
                    "counts")  # fmt: skip
    found = _newest_checkpoint(Path(cfg.checkpoint.dir))
    if found is None:
        return lost
    path, state = found
    run_id, step = state.get("run_id"), state.get("step")
    shown = int(state.get("counters", {}).get("groups_consumed", 0))
    if run_id and identity is None:
        lost.append(f"Redis holds nothing of run {run_id}, which {path} shows trained to step {step} ({shown} "
                    f"groups): it lost the run's state (the learner records it when it next starts)")  # fmt: skip
    elif run_id and identity is not None and identity.id != run_id:
        lost.append(f"Redis holds run {identity.id} under this run.name, not run {run_id} of {path}")
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


def _holder(t: Transport) -> tuple[LeaseHolder | None, str | None]:
    """The learner that holds the run, or why ``learner:lease`` cannot be read."""
    try:
        return t.lease_holder(), None
    except SchemaError as e:
        return None, str(e)


def _announced(t: Transport) -> tuple[WeightsAnnouncement | None, str | None]:
    """The announced weights, or why ``weights:latest`` cannot be read (reported, not a traceback)."""
    try:
        return t.latest_weights(), None
    except SchemaError as e:
        return None, str(e)
