"""The pieces of `grpo run`'s view that are pure: the clock, the ETA from the learner's rows, and the start-up line."""

from __future__ import annotations

import pytest

from common.step_line import clock, eta_s, step_line
from ops.live_view import Startup, waiting_for


def test_clock() -> None:
    assert [clock(s) for s in (0, 42, 61.9, 3725)] == ["0:00", "0:42", "1:01", "1:02:05"]
    assert clock(None) == "-"


def test_the_step_line_the_learner_logs_and_grpo_run_prints() -> None:
    r = {"step": 12, "reward": 0.4123, "frac_reward_zero_std": 0.125, "staleness/mean": 0.5, "groups_per_s": 1.34}
    assert step_line(r, 200, 0.85, 31.0, 83.0) == (
        "step   12/200  reward 0.412  accuracy 0.85  zero-std 0.12  staleness 0.50  1.3 groups/s  elapsed 0:31  "
        "eta 1:23"
    )
    assert "accuracy -  " in step_line(r, 200, None, 0.0, None) and step_line(r, 200, None, 0.0, None).endswith("eta -")


def row(step: int, elapsed: float, step_s: float = 1.0, wait_s: float = 0.0) -> dict:
    return {"step": step, "time/elapsed_s": elapsed, "time/step_s": step_s, "time/wait_s": wait_s}


def test_eta_from_the_learners_recent_rate() -> None:
    assert eta_s([{"step": 0, "eval/accuracy": 0.1}], 10) is None  # no step trained yet
    # One step: its own time less its wait for the first groups (12 s - 10 s), for the 9 steps left.
    assert eta_s([row(0, 5.0), row(1, 17.0, step_s=12.0, wait_s=10.0)], 10) == pytest.approx(18.0)
    # Steps 1..5 at 3 s each after a slow start: (5 - 1) steps in 12 s, 5 steps left.
    rows = [row(1, 20.0)] + [row(s, 20.0 + 3 * (s - 1)) for s in range(2, 6)]
    assert eta_s(rows, 10) == pytest.approx(15.0)
    # The rate is the last 20 steps': 30 steps at 10 s, then 20 at 1 s.
    rows = [row(s, 10.0 * s) for s in range(1, 31)] + [row(s, 300.0 + (s - 30)) for s in range(31, 51)]
    assert eta_s(rows, 60) == pytest.approx(10.0)
    assert eta_s(rows, 50) == 0.0


def startup(**changes: object) -> Startup:
    base = dict(missing=[], started=3, announced=True, evaluated=True, actors=2, actors_ready=2, produced=3, batch=8)
    return Startup(**{**base, **changes})  # type: ignore[arg-type]


def test_the_start_up_line_names_what_the_run_waits_for() -> None:
    assert waiting_for(startup(missing=["learner", "actor-2"], announced=False)) == (
        "processes",
        "waiting for the learner, actor-2 to start (1 of 3 up)",
    )
    assert waiting_for(startup(announced=False, evaluated=False, actors_ready=1)) == (
        "model",
        "waiting for the learner to load the model; 1 of 2 actors have loaded the model",
    )
    assert waiting_for(startup(evaluated=False)) == ("evaluation", "waiting for the learner to evaluate step 0")
    assert waiting_for(startup()) == ("groups", "waiting for the actors' first groups: 3 of the 8 that step 1 takes")
    # The groups are there and a real model's first step takes minutes: say what the learner does, not "17 of 8".
    assert waiting_for(startup(produced=17)) == (
        "training",
        "the learner is training step 1 (17 groups sent, 8 a step)",
    )
    assert waiting_for(startup(actors=0, actors_ready=1, started=1)) == (
        "groups",
        "waiting for groups from the actors you start (run.actors=0): 3 of the 8 that step 1 takes",
    )


def test_the_plain_view_says_since_when_it_waits(capsys: pytest.CaptureFixture[str]) -> None:
    from common.config import load_config
    from ops.live_view import Progress

    clock_now = [100.0]
    view = Progress(load_config(None, []), live=False, started=40.0)
    view.elapsed = lambda: clock_now[0] - 40.0  # type: ignore[method-assign]
    view.starting(startup(produced=3))  # 1:00 after the start: the stage begins
    clock_now[0] = 170.0
    view.starting(startup(produced=9))  # a new stage at 2:10: its own since
    clock_now[0] = 230.0
    view.starting(startup(produced=9))  # the same line: nothing printed
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "[1:00] waiting for the actors' first groups: 3 of the 8 that step 1 takes, since 1:00",
        "[2:10] the learner is training step 1 (9 groups sent, 8 a step), since 2:10",
    ]
    assert view.waiting == "the learner is training step 1 (9 groups sent, 8 a step), since 2:10"


def test_difficulty_samplings_choices_follow_each_plain_step_line(capsys: pytest.CaptureFixture[str]) -> None:
    from common.config import load_config
    from ops.live_view import Progress, passed_over

    choices = {"taken:unseen": 40, "taken:informative": 98, "passed:unsolved": 99, "passed:informative": 2,
               "passed:solved": 0}  # fmt: skip
    assert passed_over(choices) == "passed over 101 of 239 positions (informative 2, unsolved 99)"
    assert passed_over({}) == "passed over 0 of 0 positions"
    view = Progress(load_config(None, []), live=False, started=0.0)
    view.sampled(choices)
    row = {"step": 3, "reward": 0.5, "frac_reward_zero_std": 0.25, "staleness/mean": 0.5, "groups_per_s": 1.0}
    view.update([row])
    assert capsys.readouterr().out.rstrip().endswith("passed over 101 of 239 positions (informative 2, unsolved 99)")
