"""The learner's record of each step: the metrics.jsonl row, its Prometheus gauges, the trackers, and the alarms.

Rank 0 alone writes it. metrics.jsonl is strict JSON, one row per step (DESIGN §4 keys first, then the others, and
``lease_token``, the fencing token of the learner that wrote it); a row reaches the file before the checkpoint that
covers its step, and rows past a checkpoint are dropped when a learner resumes from it (their steps are trained
again).

A file has no fence, so a learner that lost the run (frozen past its lease between its last check and a row) must not
be able to append to its successor's file: each holder, as soon as it holds the run, replaces metrics.jsonl (the rows
it keeps, synced, renamed over it: a new file) and appends only through the descriptor it opened then. A predecessor
that wakes up appends to the file it opened, which no reader finds any more; it sees that the file at the path is no
longer its own, checks the lease, and stops (:class:`LeaseLost`) before its row reaches a tracker.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import IO, Any

from common.config import Config
from common.metrics import LearnerMetrics
from common.step_line import eta_s, step_line
from common.storage import StorageError, fsync_dir, fsync_file, writing
from common.transport import LearnerTransport, read_balance
from learner.alarms import Alarms
from learner.progress import Progress
from learner.trackers import Trackers, open_trackers

log = logging.getLogger("learner")

# The metrics.jsonl keys DESIGN §4 names, in their order (the clip ratios are 0.0 on a step with no update).
_REWARD_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "reward/trained")
_CLIP_KEYS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
_POLICY_KEYS = ("entropy", "completions/mean_length", "staleness/mean", "staleness/max", "loss", "lr")


class Record:
    def __init__(self, cfg: Config, transport: LearnerTransport, metrics: LearnerMetrics, is_rank0: bool):
        self.cfg = cfg
        self.transport = transport
        self.metrics = metrics
        self.is_rank0 = is_rank0
        self.path = Path(cfg.run.dir) / "metrics.jsonl"
        lc = cfg.learner
        self.alarms = Alarms(lc.alarm_window, lc.alarm_clip_ratio, lc.alarm_zero_std)
        self.trackers = Trackers()  # run.trackers, opened on rank 0 once the run's identity is known
        self.started = time.perf_counter()
        self.accuracy: float | None = None  # the newest held-out accuracy, for the progress line
        self._recent: list[dict[str, Any]] = []  # the last rows, for the progress line's ETA
        self._file: IO[str] | None = None  # metrics.jsonl as this learner opened it (see truncate)

    def open_trackers(self, run_id: str, first_row: int) -> None:
        """After the run's identity (``run_id`` names the W&B run); ``first_row``: the step of the next row."""
        self.trackers = open_trackers(self.cfg, run_id, first_row)

    def metrics_row(self, stats: dict[str, float], p: Progress) -> dict[str, Any]:
        """The metrics.jsonl row of the step ``p`` has just taken (DESIGN §4 keys first)."""
        elapsed = time.perf_counter() - self.started
        row: dict[str, Any] = {
            "step": p.step,
            "policy_version": p.version,
            **{k: stats[k] for k in _REWARD_KEYS},
            **{k: stats.get(k, 0.0) for k in _CLIP_KEYS},
            **{k: stats[k] for k in _POLICY_KEYS},
            "groups_consumed": p.groups_consumed,
            "groups_dropped": sum(p.dropped.values()),
            "groups_dead": p.dead,
            "time/step_s": stats["time/step_s"],
            "time/elapsed_s": elapsed,
            "groups_per_s": p.groups_consumed / elapsed,
            "tokens_per_s": stats["tokens"] / max(stats["time/train_s"], 1e-9),
        }
        row |= {k: v for k, v in stats.items() if k not in row and k != "tokens"}
        return row

    def stream_figures(self) -> dict[str, float]:
        """Groups waiting in the stream, for dashboards (one transaction, as the accounting equation reads them)."""
        b = read_balance(self.transport)
        self.metrics.stream_groups.labels("unread").set(b.unread)
        self.metrics.stream_groups.labels("pending").set(b.pending)
        self.metrics.unexplained.set(b.unexplained)
        return {"stream/unread": b.unread, "stream/pending": b.pending}

    def write(self, row: dict[str, Any]) -> None:
        """Append the row, with this learner's ``lease_token``, to metrics.jsonl, then the trackers, then the
        Prometheus gauges (rank 0). :class:`LeaseLost` when another learner took the run over (it replaced the
        file): the row reached no file anyone reads, and no tracker."""
        if not self.is_rank0:
            return
        row = {**row, "lease_token": self.transport.lease_token()}
        line = _json_row(row) + "\n"
        with writing(self.path):
            f = self._file or self._open()
            f.write(line)
            f.flush()
            if not self._ours():
                self._replaced(line)
        if "eval/accuracy" in row:
            self.accuracy = row["eval/accuracy"]
        self.trackers.log(row)  # after metrics.jsonl, the record; a tracker's failure never reaches training
        self.metrics.step.set(row["step"])
        self.metrics.policy_version.set(row["policy_version"])
        if "reward" in row:  # step 0's row has the evaluation alone
            self._export(row)

    def _export(self, row: dict[str, Any]) -> None:
        m = self.metrics
        m.reward.set(row["reward"])
        m.reward_trained.set(row["reward/trained"])
        m.frac_zero_std.set(row["frac_reward_zero_std"])
        for region in ("low", "high", "region"):
            m.clip_ratio.labels(region).set(row[f"clip_ratio/{region}_mean"])
        m.entropy.set(row["entropy"])
        m.staleness.labels("mean").set(row["staleness/mean"])
        m.staleness.labels("max").set(row["staleness/max"])
        m.staleness.labels("token_mean").set(row["staleness/token_mean"])
        m.loss.set(row["loss"])
        if "kl" in row:
            m.kl.set(row["kl"])
        m.lr.set(row["lr"])
        m.tokens_per_s.set(row["tokens_per_s"])
        m.step_seconds.observe(row["time/step_s"])

    def log_progress(self, row: dict[str, Any]) -> None:
        """Every ``learner.log_every`` steps and at the last, the step's line (common.step_line.step_line) in the log:
        a learner run alone (docker compose, Kubernetes) says how it goes without a dashboard."""
        self._recent = [*self._recent[-40:], row]
        every, steps = self.cfg.learner.log_every, self.cfg.run.steps
        if every and (row["step"] % every == 0 or row["step"] == steps):
            eta = eta_s(self._recent, steps)
            log.info("%s", step_line(row, steps, self.accuracy, row["time/elapsed_s"], eta))

    def raise_alarms(self, row: dict[str, Any]) -> None:
        for message in self.alarms.update(row):
            log.warning("alarm: %s", message)
        for kind, on in self.alarms.active.items():
            self.metrics.alarm.labels(kind).set(int(on))

    def truncate(self, step: int) -> None:
        """Take metrics.jsonl over as this learner starts (``step``: the checkpoint it resumes from, -1: none). Rows
        of steps after it are about to be trained again: dropped rather than repeated. A last row cut short (the disk
        filled up, or the learner died, while it was written) is dropped with a warning: its step is trained again
        like the others past the checkpoint. The file is replaced whatever it holds (a new file at the path), and
        this learner appends to it alone: an earlier holder that wakes up appends to the file it had opened."""
        take_over_rows(self.path, step)
        self._close_file()
        self._open()

    def _open(self) -> IO[str]:
        self._file = self.path.open("a")
        return self._file

    def _ours(self) -> bool:
        """Whether the file at the path is still the one this learner appends to."""
        assert self._file is not None
        try:
            at_path = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(self._file.fileno())
        return (mine.st_dev, mine.st_ino) == (at_path.st_dev, at_path.st_ino)

    def _replaced(self, line: str) -> None:
        """The file at the path is not the one this learner opened: another learner took the run over (it replaced
        the file as it started; the lease check raises :class:`LeaseLost`), or, while this one still holds the run,
        something else replaced or removed it: the row goes to the file now at the path, opened anew."""
        if self.transport.lease_token():
            self.transport.renew_lease()
        log.warning("%s was replaced or removed by something other than a learner: appending to the file now there",
                    self.path)  # fmt: skip
        self._close_file()
        f = self._open()
        f.write(line)
        f.flush()

    def sync(self) -> None:
        """The rows written so far reach the disk (before a checkpoint that covers their steps)."""
        if self._file is not None:
            with writing(self.path):
                self._file.flush()
                os.fsync(self._file.fileno())
        elif self.path.exists():
            with writing(self.path):
                fsync_file(self.path)

    def _close_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as e:  # a full disk refusing the last flush: the rows are re-read from the file anyway
                log.debug("closing %s: %s", self.path, e)
            self._file = None

    def close(self) -> None:
        self._close_file()
        self.trackers.close()


def _json_row(row: dict[str, Any]) -> str:
    """Strict JSON (``Infinity`` and ``NaN`` are not JSON): a figure that is not a finite number, such as the loss
    of a step whose every update was skipped, is written as null."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
    return json.dumps(clean, allow_nan=False)


def take_over_rows(path: Path, step: int, *, only_if_there: bool = False) -> None:
    """Replace metrics.jsonl (``path``) with its rows of steps up to ``step`` (see :meth:`Record.truncate`). A
    learner does it twice: as soon as it holds the run (learner.process._hold, ``only_if_there``: before it loads the
    model, so that a predecessor waking up meanwhile finds the file replaced and stops before its row reaches a
    tracker), and as it resumes (the checkpoint it resumed from may be older than the newest it saw first)."""
    with writing(path):
        if only_if_there and not path.exists():
            return
        text = path.read_text() if path.exists() else ""
        rows = [json.loads(line) for line in metrics_rows(text, path)]
        _rewrite(path, [row for row in rows if row.get("step", 0) <= step])


def _rewrite(path: Path, rows: list[dict[str, Any]]) -> None:
    """Replace metrics.jsonl with ``rows`` atomically (a crash leaves the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".metrics.jsonl.tmp-{os.getpid()}")
    with tmp.open("w") as f:
        f.write("".join(_json_row(row) + "\n" for row in rows))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def metrics_rows(text: str, path: Path) -> list[str]:
    """The rows of metrics.jsonl. Only the last can be cut short (rows are appended, and the file is truncated to
    its complete rows before a learner appends again): it is left out with a warning. Any other line that is not
    JSON was damaged some other way: :class:`StorageError`, one line."""
    lines = text.splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            json.loads(line)
        except ValueError:
            if n == len(lines):
                log.warning("%s: the last row (line %d) was cut short, left out: its step is trained again", path, n)
                continue
            raise StorageError(path, f"line {n} is not JSON; fix or remove it") from None
        rows.append(line)
    return rows
