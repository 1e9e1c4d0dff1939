"""Borrowing idle cores (common.idle_cores): the pure rule, the /proc/stat reading, and the borrower's choices over
time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.idle_cores import CoreBorrower, busy_seconds, quota_cores, threads_for


@pytest.mark.parametrize(
    ("base", "cores", "others", "threads"),
    [
        (1, 2, 0.0, 2),  # the actor waits: its core is the learner's
        (1, 2, 0.2, 2),  # Redis and the grader's odd job leave the core idle enough
        (1, 2, 0.3, 1),  # the actor runs part of the time: no borrowing
        (1, 2, 1.0, 1),
        (1, 2, 1.7, 1),  # never below the role's own setting
        (1, 4, 1.0, 3),  # one actor of three busy: two idle cores
        (2, 2, 0.0, 2),  # nothing left to borrow
        (1, 1, 0.0, 1),
    ],
)
def test_threads_for(base: int, cores: int, others: float, threads: int) -> None:
    assert threads_for(base, cores, others) == threads


def test_busy_seconds_counts_the_allowed_cores_all_but_idle_and_iowait(tmp_path: Path) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  900 0 900 900 900 0 0 0 0 0\n"  # the sum over every core: not read
        f"cpu0 {tick} 0 {tick} {50 * tick} {7 * tick} 0 0 0 0 0\n"
        f"cpu1 {3 * tick} 0 0 {50 * tick} 0 0 {tick} 0 0 0\n"
        f"cpu2 {100 * tick} 0 0 0 0 0 0 0 0 0\n"  # not this process's
        "intr 12345 0 0\n"
    )
    assert busy_seconds({0, 1}, stat) == pytest.approx(2 + 4)


class Clocks:
    """The machine as the borrower sees it: wall time, every allowed core's busy time, this process's CPU time."""

    def __init__(self) -> None:
        self.wall = self.busy = self.own = 0.0

    def run(self, seconds: float, own_cores: float, others: float) -> None:
        self.wall += seconds
        self.own += seconds * own_cores
        self.busy += seconds * (own_cores + others)


def borrower(clocks: Clocks, chosen: list[int], cores: int = 2) -> CoreBorrower:
    b = CoreBorrower(1, chosen.append, busy=lambda: clocks.busy, own=lambda: clocks.own, clock=lambda: clocks.wall)
    b.cores = cores
    return b


def test_the_borrower_takes_an_idle_core_and_gives_it_back_when_it_is_used() -> None:
    clocks, chosen = Clocks(), []
    b = borrower(clocks, chosen)
    clocks.run(5, own_cores=1, others=1)  # the actor samples
    assert b.adjust() == 1 and chosen == []  # unchanged: torch is not asked
    clocks.run(5, own_cores=1, others=0.05)  # the actor waits for room
    assert b.adjust() == 2 and chosen == [2]
    clocks.run(4, own_cores=2, others=0.0)  # still waiting: the learner keeps both
    assert b.adjust() == 2 and chosen == [2]
    assert b.borrowed_s == 4
    clocks.run(3, own_cores=1.4, others=0.6)  # the actor is back: its thread fights the learner's two
    assert b.adjust() == 1 and chosen == [2, 1]
    assert b.borrowed_s == 7


def test_the_borrower_keeps_its_choice_over_a_too_short_interval() -> None:
    clocks, chosen = Clocks(), []
    b = borrower(clocks, chosen)
    clocks.run(0.1, own_cores=1, others=0)
    assert b.adjust() == 1 and chosen == []
    clocks.run(0.6, own_cores=1, others=0)  # measured from the last sample taken, 0.7 s of idle
    assert b.adjust() == 2


def test_the_real_machine_is_readable() -> None:
    """On Linux the borrower reads this machine's cores; its first choice is the role's own threads or more."""
    if not Path("/proc/stat").exists():
        pytest.skip("no /proc/stat: the borrower is off on this system")
    chosen: list[int] = []
    b = CoreBorrower(1, chosen.append)
    assert 1 <= b.cores <= len(os.sched_getaffinity(0))  # a cgroup quota may cap it
    assert busy_seconds(os.sched_getaffinity(0)) > 0
    assert 1 <= b.adjust() <= b.cores


def test_a_proc_stat_that_names_none_of_the_cores_is_refused(tmp_path: Path) -> None:
    """A virtualised /proc/stat numbers its lines apart from the affinity: every core would look idle forever."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 0 1 1 0 0 0 0\ncpu0 1 0 1 1 0 0 0 0\n")
    with pytest.raises(ValueError, match="names the cores"):
        busy_seconds({4, 5}, stat)


def test_quota_cores_reads_cgroup_v2_and_v1(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert quota_cores(tmp_path) == 2  # 1.5 cores' worth: a second thread has somewhere to run part of the time
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert quota_cores(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert quota_cores(tmp_path) == 1
    assert quota_cores(tmp_path / "absent") is None


def test_a_reading_that_fails_mid_run_turns_borrowing_off_without_raising() -> None:
    """adjust() runs inside forwards and backwards: a failure there goes back to the role's threads, for good."""
    clocks, chosen = Clocks(), []
    b = borrower(clocks, chosen)
    clocks.run(5, own_cores=1, others=0)
    assert b.adjust() == 2

    def gone() -> float:
        raise OSError("no /proc")

    b.busy = gone
    clocks.run(5, own_cores=2, others=0)
    assert b.adjust() == 1 and chosen == [2, 1] and b.off
    clocks.run(5, own_cores=1, others=0)
    assert b.adjust() == 1 and chosen == [2, 1]
