"""metrics.jsonl when the run changes hands (learner.record): a learner frozen past its lease between its last check
and its row wakes up after a successor took the run over; its row never reaches the successor's file nor a tracker,
and it stops with LeaseLost. Each row carries the lease token of the learner that wrote it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from common.config import Config
from common.metrics import LearnerMetrics
from common.transport import LeaseLost
from learner.record import Record, take_over_rows
from learner.trackers import Trackers


class Lease:
    """A learner's view of its lease: its token, and the check (``renew_lease``) that Redis would refuse once
    another learner holds the run."""

    def __init__(self, token: int) -> None:
        self.token, self.lost, self.checks = token, False, 0

    def lease_token(self) -> int:
        return self.token

    def renew_lease(self) -> bool:
        self.checks += 1
        if self.lost:
            raise LeaseLost(f"this learner no longer holds the run (lease token {self.token + 1} took it over)")
        return False


class Tracked:
    name = "tracked"

    def __init__(self) -> None:
        self.steps: list[int] = []

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.steps.append(step)

    def close(self) -> None:
        pass


def record(run_dir: Path, lease: Lease) -> tuple[Record, Tracked]:
    cfg = Config()
    cfg.run.dir = str(run_dir)
    rec = Record(cfg, lease, LearnerMetrics(CollectorRegistry()), is_rank0=True)  # type: ignore[arg-type]
    tracked = Tracked()
    rec.trackers = Trackers([tracked])
    return rec, tracked


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_fenced_out_learners_row_reaches_neither_its_successors_file_nor_a_tracker(tmp_path: Path) -> None:
    first_lease, second_lease = Lease(1), Lease(2)
    first, first_tracked = record(tmp_path, first_lease)
    first.truncate(-1)  # a fresh run
    for step in range(5):
        first.write({"step": step, "policy_version": step})
    # Frozen past its lease after step 4 (its checkpoint was step 2); a successor takes the run over and resumes.
    first_lease.lost = True
    second, second_tracked = record(tmp_path, second_lease)
    second.truncate(2)
    assert [r["step"] for r in rows(tmp_path)] == [0, 1, 2]
    # The first wakes up between its check and its row of step 5: the row goes to the file it opened, which is no
    # longer metrics.jsonl; it sees that, checks the lease, and stops before any tracker gets the row.
    with pytest.raises(LeaseLost, match="lease token 2"):
        first.write({"step": 5, "policy_version": 5})
    assert first_tracked.steps == [0, 1, 2, 3, 4]
    for step in range(3, 7):
        second.write({"step": step, "policy_version": step})
    got = rows(tmp_path)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4, 5, 6]  # each step once
    assert [r["lease_token"] for r in got] == [1, 1, 1, 2, 2, 2, 2]
    assert second_tracked.steps == [3, 4, 5, 6] and second_lease.checks == 0  # no round trip on the way
    second.sync()
    first.close()
    second.close()


def test_a_successor_replaces_the_file_as_it_takes_the_run_before_it_loads_its_model(tmp_path: Path) -> None:
    """Between taking the run and resuming (loading the model can take minutes) the successor has no Record yet: it
    replaces the file at once (learner.process._hold), so that a predecessor waking up meanwhile stops at its next row
    instead of appending it to the file the successor is about to keep, and giving it to its trackers."""
    first_lease = Lease(1)
    first, first_tracked = record(tmp_path, first_lease)
    first.truncate(-1)
    for step in range(4):
        first.write({"step": step, "policy_version": step})
    first_lease.lost = True
    take_over_rows(tmp_path / "metrics.jsonl", 2, only_if_there=True)  # the successor holds the run, checkpoint 2
    with pytest.raises(LeaseLost):
        first.write({"step": 4, "policy_version": 4})
    assert first_tracked.steps == [0, 1, 2, 3] and [r["step"] for r in rows(tmp_path)] == [0, 1, 2]
    take_over_rows(tmp_path / "elsewhere" / "metrics.jsonl", 2, only_if_there=True)  # a run with no rows yet
    assert not (tmp_path / "elsewhere").exists()
    first.close()


def test_a_file_replaced_while_the_learner_holds_the_run_gets_the_next_rows(tmp_path: Path) -> None:
    """Something other than a learner replaced metrics.jsonl (an editor's save, a copy put back): the lease is
    still this learner's, so the row goes to the file now at the path, said once in the log."""
    lease = Lease(1)
    rec, tracked = record(tmp_path, lease)
    rec.truncate(-1)
    rec.write({"step": 0, "policy_version": 0})
    path = tmp_path / "metrics.jsonl"
    copy = tmp_path / "copy"
    copy.write_text(path.read_text())
    os.replace(copy, path)
    rec.write({"step": 1, "policy_version": 1})
    rec.write({"step": 2, "policy_version": 2})
    assert [r["step"] for r in rows(tmp_path)] == [0, 1, 2] and lease.checks == 1
    assert tracked.steps == [0, 1, 2]
    rec.close()
