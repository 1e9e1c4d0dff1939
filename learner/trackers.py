"""Experiment trackers (``run.trackers``): every metrics.jsonl row goes to TensorBoard and/or Weights & Biases too.

metrics.jsonl stays the record; a tracker is a copy to watch. What a tracker gets of a row:

- the names are the metrics.jsonl keys as they are (``loss``, ``clip_ratio/low_mean``, ``time/step_s``): both
  TensorBoard and W&B group charts by the part before the first ``/``, and a key found in one place is found in the
  other;
- the row's ``step`` is the x axis, not a chart; only finite numbers go (metrics.jsonl writes the others as null, and
  a tracker leaves them out);
- TensorBoard keeps 32-bit floats (its scalar format); W&B keeps the values as they are.

A learner that resumes from a checkpoint trains the steps after it again. TensorBoard: a new event file begins with
a restart marker at the first step it writes, and TensorBoard's reader drops what an earlier attempt wrote from that
step on (as metrics.jsonl drops those rows). W&B: the run's id is the run's identity in Redis (kept in checkpoints),
so a resumed learner continues the same W&B run (``resume="allow"``); W&B keeps the first value it got for a step
and ignores a step logged again.

Trackers never stop training: a missing package is a configuration mistake found before anything starts
(:func:`check_trackers`), and a tracker that fails to start or fails later (a full disk, a lost connection) is
reported by one warning and gets no more rows, while metrics.jsonl goes on. Only rank 0 of a distributed learner
opens trackers (it alone writes the run's files). The one exception that does stop training passes through every
tracker call: :class:`LeaseLost`, which the learner's lease thread raises in the training loop wherever it is, a
tracker's call included, when another learner took the run over (it must stop at once, exit code 5). A row reaches
the trackers only after metrics.jsonl took it as the run's (learner.record): a learner that lost the run sends none.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from common.config import Config, ConfigError
from common.transport import LeaseLost

log = logging.getLogger("learner")

# The modules each tracker imports, and so the pip extra (of the same name as the tracker) that provides them.
MODULES: dict[str, tuple[str, ...]] = {
    "tensorboard": (
        "tensorboard.compat.proto.event_pb2",
        "tensorboard.compat.proto.summary_pb2",
        "tensorboard.summary.writer.record_writer",
    ),
    "wandb": ("wandb",),
}


class Tracker(Protocol):
    name: str

    def log(self, values: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def check_trackers(names: Iterable[str]) -> None:
    """Import what each configured tracker needs, before any work starts: a missing package is the user's to fix
    (one line naming ``run.trackers`` and the extra to install; exit 2), not a traceback hours into a run."""
    for name in names:
        for module in MODULES[name]:
            try:
                importlib.import_module(module)
            except ImportError as e:
                raise ConfigError(
                    f"config error: run.trackers: {name} needs a package that is not installed ({e}): "
                    f"pip install 'grpo-pipeline[{name}]', or remove {name} from run.trackers"
                ) from None


def numeric(row: Mapping[str, Any]) -> dict[str, float]:
    """The values of a row that a tracker charts: finite numbers, except ``step`` (the x axis)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class TensorBoard:
    """Event files in ``directory``, written by tensorboard's own record writer: synchronously, one event per row,
    flushed at once (rows come seconds apart; someone watching sees each step as it ends, and a write that fails
    raises here, in the row's call, rather than in a background thread)."""

    name = "tensorboard"

    def __init__(self, directory: Path, first_step: int):
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary = Event, Summary
        directory.mkdir(parents=True, exist_ok=True)
        # TensorBoard reads a directory's event files in name order: the time in nanoseconds first keeps that the
        # order they were written in (the restart marker below relies on it), whichever host wrote them.
        path = directory / f"events.out.tfevents.{time.time_ns()}.{socket.gethostname()}.{os.getpid()}"
        self._file = path.open("xb")
        self._writer = RecordWriter(self._file)
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        # Steps from first_step on are written from here (again, after a resume): TensorBoard's reader drops what
        # earlier files hold for them.
        self._write(Event(wall_time=time.time(), step=first_step, session_log=SessionLog(status=SessionLog.START)))

    def log(self, values: Mapping[str, float], step: int) -> None:
        summary = self._summary(value=[self._summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self._write(self._event(wall_time=time.time(), step=step, summary=summary))

    def _write(self, event: Any) -> None:
        self._writer.write(event.SerializeToString())
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandB:
    """A W&B run named ``run.name`` in ``run.wandb_project``, its local files in ``<run.dir>/wandb``. Its id is the
    run's identity, so that a resumed learner continues it. Online or offline is W&B's own setting (``WANDB_MODE``,
    ``wandb login``)."""

    name = "wandb"

    def __init__(self, cfg: Config, run_id: str):
        import wandb

        self._wandb = wandb
        logging.getLogger("wandb").setLevel(logging.WARNING)  # its start-up story is in <run.dir>/wandb/*/logs
        self._run = wandb.init(
            project=cfg.run.wandb_project,
            name=cfg.run.name,
            id=run_id,
            resume="allow",
            dir=cfg.run.dir,
            config=cfg.resolved_dict(),  # config.json's tree: secrets left out or masked
        )

    def log(self, values: Mapping[str, float], step: int) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()
        # finish() may return before W&B's service process has written the run's file; teardown waits for that (the
        # learner exits next, and the last rows must be on disk for `wandb sync` of an offline run).
        self._wandb.teardown()


class Trackers:
    """Each row to every tracker that still works. A tracker's failure never reaches training: any error (a full
    disk, a lost connection, an error of the tracker's library) is reported once and that tracker is left out."""

    def __init__(self, trackers: Sequence[Tracker] = ()):
        self._live = list(trackers)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self._live]

    def log(self, row: Mapping[str, Any]) -> None:
        values, step = numeric(row), int(row["step"])
        for tracker in list(self._live):
            try:
                tracker.log(values, step)
            except LeaseLost:  # raised in this thread by the lease's, wherever it was: the learner stops
                raise
            except Exception as e:  # see the class: whatever the tracker's library raises, training goes on
                self._drop(tracker, f"failed at step {step}", e)

    def close(self) -> None:
        for tracker in self._live:
            try:
                tracker.close()
            except LeaseLost:
                raise
            except Exception as e:  # its last rows may be lost; metrics.jsonl has them
                log.warning("tracker %s: closing it failed (%s: %s); metrics.jsonl has every row",
                            tracker.name, type(e).__name__, e)  # fmt: skip
        self._live = []

    def _drop(self, tracker: Tracker, what: str, e: BaseException) -> None:
        log.warning("tracker %s %s (%s: %s): it gets no more rows; training goes on and metrics.jsonl has every row",
                    tracker.name, what, type(e).__name__, e)  # fmt: skip
        self._live.remove(tracker)
        try:
            tracker.close()
        except LeaseLost:
            raise
        except Exception:  # it already failed once and was reported
            pass


def open_trackers(cfg: Config, run_id: str, first_step: int) -> Trackers:
    """The trackers of ``run.trackers``; ``first_step`` is the step of the next row (0, or the step after the
    checkpoint a learner resumed from). One that cannot start is reported and left out: training goes on."""
    opened: list[Tracker] = []
    for name in cfg.run.trackers:
        try:
            if name == "tensorboard":
                opened.append(TensorBoard(Path(cfg.run.dir) / "tensorboard", first_step))
            else:
                opened.append(WandB(cfg, run_id))
        except LeaseLost:
            raise
        except Exception as e:  # as in Trackers.log: no tracker stops training
            log.warning("tracker %s could not start (%s: %s): training goes on without it; metrics.jsonl has every "
                        "row", name, type(e).__name__, e)  # fmt: skip
    if opened:
        log.info("trackers: %s", ", ".join(t.name for t in opened))
    return Trackers(opened)
