"""common.liveness: a loop's beats against their bound, on a hand-made clock, and the stack a stall logs."""

from __future__ import annotations

import logging
import threading

import pytest

from common.liveness import Liveness


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def liveness(clock: Clock, bound: float = 60.0) -> Liveness:
    return Liveness(bound, clock=clock, wall=lambda: 1_700_000_000.0 + clock.now, role="learner", step=0)


def test_ok_while_the_last_beat_is_within_the_bound_and_not_after() -> None:
    clock = Clock()
    life = liveness(clock)
    life.beat("training step 1")
    clock.now += 60.0
    ok, info = life.report()
    assert ok and info["doing"] == "training step 1" and info["quiet_s"] == 60.0 and info["stall_after_s"] == 60.0
    clock.now += 0.5
    ok, info = life.report()
    assert not ok and info["quiet_s"] == 60.5 and not info["ready"]
    life.beat("training step 1")  # it moves again: ok again
    assert life.report()[0]


def test_a_wait_that_beats_as_it_goes_stays_ok_however_long_it_lasts() -> None:
    clock = Clock()
    life = liveness(clock)
    life.beat("waiting for groups")
    for _ in range(100):  # 50 minutes of slow actors, a beat at each read
        clock.now += 30.0
        life.beat("waiting for groups")
        assert life.report()[0]
    info = life.report()[1]
    # The same step beating again keeps its start: since when it has been waiting, not since the last read.
    assert info["for_s"] == 3000.0 and info["quiet_s"] == 0.0
    assert info["since"] == "2023-11-14T22:30:00+00:00"  # the wall time of its first beat (1_700_001_000)


def test_a_new_step_starts_its_own_time() -> None:
    clock = Clock()
    life = liveness(clock)
    life.beat("waiting for groups")
    clock.now += 50.0
    life.beat("training step 3", step=2, version=2)
    clock.now += 10.0
    ok, info = life.report()
    assert ok and info["for_s"] == 10.0 and info["step"] == 2 and info["version"] == 2 and info["role"] == "learner"


def test_a_step_with_its_own_allowance_and_the_default_after_it() -> None:
    clock = Clock()
    life = liveness(clock)
    life.beat("waiting for the run's lease", 3600.0 + 60.0, starting=True)
    clock.now += 3000.0
    ok, info = life.report()
    assert ok and info["stall_after_s"] == 3660.0
    life.beat("loading the model", starting=True)
    clock.now += 61.0
    ok, info = life.report()
    assert not ok and info["stall_after_s"] == 60.0  # the next step is back to the default bound


def test_ready_once_the_start_is_over_and_while_alive() -> None:
    clock = Clock()
    life = liveness(clock)
    ok, info = life.report()
    assert ok and info["doing"] == "starting" and not info["ready"]  # before the first beat
    life.beat("loading the model", starting=True)
    assert life.report()[0] and not life.report()[1]["ready"]
    life.beat("taking up the run", starting=True)
    assert not life.report()[1]["ready"]
    life.beat("waiting for groups")
    assert life.report()[1]["ready"]
    life.beat("evaluating", starting=True)  # a later step marked starting does not undo it
    assert life.report()[1]["ready"]
    clock.now += 61.0
    ok, info = life.report()
    assert not ok and not info["ready"]


def test_the_first_report_of_a_stall_logs_the_loops_stack_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    life = liveness(clock, bound=5.0)
    beaten, release = threading.Event(), threading.Event()

    def loop_stuck_in_a_call() -> None:
        life.beat("evaluating")
        beaten.set()
        release.wait(30)  # the call that never returns

    thread = threading.Thread(target=loop_stuck_in_a_call)
    thread.start()
    try:
        assert beaten.wait(10)
        clock.now += 6.0
        with caplog.at_level(logging.ERROR, logger="common.liveness"):
            ok, info = life.report()
            life.report()
        assert not ok
        assert "in loop_stuck_in_a_call" in info["stuck_at"] or "in wait" in info["stuck_at"], info["stuck_at"]
        (record,) = [r for r in caplog.records if "has not moved" in r.getMessage()]  # once, not per probe
        message = record.getMessage()
        assert "while evaluating" in message and "loop_stuck_in_a_call" in message and "release.wait(30)" in message
    finally:
        release.set()
        thread.join()
    ok, info = life.report()
    assert not ok and info["stuck_at"] == "the loop's thread has ended"
