"""``grpo run``: the whole pipeline on this machine, as separate processes talking through Redis.

``prepare → start Redis → start the learner and actors → watch → summarise → stop everything``. The children are
the same ``grpo learner`` / ``grpo actor`` entry points that docker compose runs, started with the resolved
``config.json``; their logs go to ``<run.dir>/logs/``. Every child is stopped by PID on completion, on Ctrl-C, and
when any child dies (then this command exits non-zero and says which child and why); each child also dies with
this process if it is killed outright.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from common.cli import EXIT_USAGE, role_parser
from common.config import ConfigError, check_device, check_engine, load_config, write_resolved
from common.log import setup_logging
from common.transport import Transport, read_balance
from ops.launcher import ACTOR_EXIT_GRACE_S, ChildFailed, Interrupted, Run

if TYPE_CHECKING:
    from ops.live_view import Progress

log = logging.getLogger("run")


def main(argv: Sequence[str]) -> int:
    parser = role_parser("grpo run", __doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--plain", action="store_true", help="print progress lines instead of a live view")
    args = parser.parse_args(list(argv))
    cfg = load_config(args.config, args.override)
    setup_logging("run", cfg.run.log_level)
    check_device(cfg.model.device)  # the learner's, before any directory or process exists
    # the actors' servers, likewise
    check_engine(cfg.actor.engine, cfg.sglang.url, cfg.sglang.device, cfg.learner.lora.rank)
    from ops.live_view import Progress  # rich loads only after the arguments are valid

    if cfg.metrics.port:
        raise ConfigError("config error: metrics.port: must be 0 under `grpo run` (each process takes a free port)")
    run = Run(cfg)
    progress = Progress(cfg, live=not args.plain and sys.stdout.isatty(), started=run.started)

    def on_signal(signum: int, _frame: Any) -> None:
        raise Interrupted(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        start_run(run, progress)
        watch_run(run, progress)
        return end_run(run, progress)
    except ChildFailed as e:
        if e.code == EXIT_USAGE:  # the child said what to fix in one line: so does grpo run
            log.error("%s (log: %s)", e.line, run.run_dir / "logs")
            return EXIT_USAGE
        log.error("%s", e)
        return 1
    except Interrupted as e:
        log.warning("interrupted (%s): stopping every process of the run", e)
        return 128 + e.signum
    finally:
        clean_up(run, old)


def start_run(run: Run, progress: Progress) -> None:
    """Prepare, start Redis, start the learner and actors. Every check of the user's input comes first: a start that
    fails on one leaves no directory behind."""
    run.check_task()
    run.prepare_model()
    run.check_env()
    run.check_redis()
    run.prepare_dir()
    run.start_redis()
    write_resolved(run.cfg, run.run_dir / "config.json")
    run.start_children()
    progress.header()
    if run.cfg.run.actors == 0:
        progress.say(run.actors_to_start())


def watch_run(run: Run, progress: Progress) -> None:
    """Show the run until the learner has finished (:class:`ChildFailed` when any child dies first)."""
    with progress:
        progress.endpoints(run.wait_for_endpoints(lambda: progress.starting(run.startup())))
        while not run.check_children():
            progress.update(run.read_rows())
            if not progress.last:  # until the first step: what the run waits for
                progress.starting(run.startup())
            if (choices := run.sampling_choices()) is not None:
                progress.sampled(choices)
            time.sleep(0.25)
    run.close_watcher()
    progress.update(run.read_rows())
    progress.finish()


def end_run(run: Run, progress: Progress) -> int:
    """Stop the children and summarise: 0, or 1 when the accounting does not balance."""
    run.wait_actors(ACTOR_EXIT_GRACE_S)
    run.stop_children()
    t = Transport(run.cfg.redis, run.cfg.run.name)
    try:
        balance, prompts = read_balance(t), t.prompt_balance()
        _, choices = t.sampling_choices()
    finally:
        t.close()
    from ops.live_view import summarise

    summary = summarise(run.rows, balance, time.perf_counter() - run.started, choices, prompts)
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    progress.summary(summary)
    if balance.unexplained or prompts.unexplained:
        log.error("the accounting does not balance: %s; %s", balance.equation(), prompts.equation())
        return 1
    return 0


def clean_up(run: Run, old: dict[signal.Signals, Any]) -> None:
    """Stop everything, whatever ended the run, and give the signals back their handlers ``old``."""
    for s in old:  # a second Ctrl-C must not cut the clean-up short
        signal.signal(s, signal.SIG_IGN)
    run.stop_children()
    if run.redis_server is not None:
        run.redis_server.stop()
    run.close_watcher()
    for s, handler in old.items():
        signal.signal(s, handler)
    if run.prepared:
        shutil.rmtree(run.run_dir / "redis", ignore_errors=True)
        run.undo_dir()  # a start that failed before any process of the run started leaves nothing behind
