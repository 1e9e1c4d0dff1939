"""The learner's record of each step: the metrics.jsonl row, its Prometheus gauges, the trackers, and the alarms.

Rank 0 alone writes it. metrics.jsonl is strict JSON, one row per step (DESIGN §4 keys first); a row reaches the
file before the checkpoint that covers its step, and rows past a checkpoint are dropped when a learner resumes from it
(their steps are trained again).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from common.config import Config
from common.metrics import LearnerMetrics
from common.pace import eta_s, step_line
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
        """Append the row to metrics.jsonl, then the trackers, then the Prometheus gauges (rank 0)."""
        if not self.is_rank0:
            return
        with writing(self.path), self.path.open("a") as f:
            f.write(_json_row(row) + "\n")
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
        """Every ``learner.log_every`` steps and at the last, the step's line (common.pace.step_line) in the log:
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
        """Rows of steps after the checkpoint are about to be trained again: drop them rather than repeat them. A
        last row cut short (the disk filled up, or the learner died, while it was written) is dropped with a
        warning: its step is trained again like the others past the checkpoint."""
        if not self.path.exists():
            return
        with writing(self.path):
            text = self.path.read_text()
            rows = [json.loads(line) for line in metrics_rows(text, self.path)]
            kept = [row for row in rows if row.get("step", 0) <= step]
            lines = sum(1 for line in text.splitlines() if line.strip())
            if len(kept) < lines or (text and not text.endswith("\n")):  # rows past the checkpoint, or a torn one
                self._rewrite(kept)

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        """Replace metrics.jsonl with ``rows`` atomically (a crash leaves the old file or the new one)."""
        tmp = self.path.with_name(".metrics.jsonl.tmp")
        with tmp.open("w") as f:
            f.write("".join(_json_row(row) + "\n" for row in rows))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)

    def sync(self) -> None:
        """The rows written so far reach the disk (before a checkpoint that covers their steps)."""
        if self.path.exists():
            with writing(self.path):
                fsync_file(self.path)

    def close(self) -> None:
        self.trackers.close()


def _json_row(row: dict[str, Any]) -> str:
    """Strict JSON (``Infinity`` and ``NaN`` are not JSON): a figure that is not a finite number, such as the loss
    of a step whose every update was skipped, is written as null."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
    return json.dumps(clean, allow_nan=False)


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
