"""actor.difficulty and actor.prompts: which problems come next, given the run's record and seed.

The record here is an in-memory stand-in for the Redis hash (tests/integration/test_problem_record.py runs the real
script); what is tested is the sampler's logic: cursor order kept, saturated problems passed over but never for good,
no two actors alike within a pass, rounds always whole.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from actor.difficulty import (
    appended,
    choose,
    draw_chance,
    outcome,
    pool,
    position_cap,
    uniform,
)
from actor.prompts import PromptSource
from common.config import Config
from common.metrics import ActorMetrics
from common.tasks import Problem, Task, addition_task


class Record:
    """The shared cursor and the record, as one Redis would hold them for every actor of a run."""

    def __init__(self) -> None:
        self.cursor = 0
        self.histories: dict[str, str] = {}
        self.choices: Counter[str] = Counter()

    def next_prompts(self, k: int) -> list[int]:
        self.cursor += k
        return list(range(self.cursor - k, self.cursor))

    def histories_of(self, ids: Sequence[str], window: int) -> list[str]:
        return [self.histories.get(i, "")[-window:] for i in ids]

    def record_outcomes(self, outcomes: Sequence[tuple[str, str]], window: int, counts: Mapping[str, int]) -> None:
        for problem_id, o in outcomes:
            self.histories[problem_id] = appended(self.histories.get(problem_id, ""), o, window)
        self.choices.update(counts)


class ActorSide:
    """One actor's view of the shared record (ActorTransport's methods that PromptSource calls)."""

    def __init__(self, record: Record):
        self.record = record

    def next_prompts(self, k: int, holder: str, lease_s: float, *, new_round: bool = True) -> list[int]:
        return self.record.next_prompts(k)

    def histories(self, ids: Sequence[str], window: int) -> list[str]:
        return self.record.histories_of(ids, window)

    def record_outcomes(self, outcomes: Sequence[tuple[str, str]], window: int, counts: Mapping[str, int]) -> None:
        self.record.record_outcomes(outcomes, window, counts)


def source(record: Record, task: Task, sampling: str = "difficulty", **actor: object) -> PromptSource:
    cfg = Config.model_validate({"actor": {"prompt_sampling": sampling, **actor}, "run": {"seed": 3}})
    return PromptSource(cfg, task, ActorSide(record), ActorMetrics(CollectorRegistry()))  # type: ignore[arg-type]


def test_a_groups_outcome_and_a_problems_pool() -> None:
    assert [outcome(r) for r in ([1, 0, 1], [1, 1, 1], [0, 0, 0], [0.5, 0.5])] == ["m", "r", "w", "r"]
    assert [pool(h) for h in ("", "rrm", "rrr", "ww", "rw")] == ["unseen", "informative", "solved", "unsolved",
                                                                  "flipping"]  # fmt: skip
    assert appended("mrrw", "m", 4) == "rrwm" and appended("", "w", 4) == "w"


def test_the_draw_chance_is_the_informative_share_never_below_the_floor() -> None:
    assert draw_chance("", 0.1) == 1.0  # never graded: always drawn
    assert draw_chance("mm", 0.1) == 1.0
    assert draw_chance("mrrr", 0.1) == 0.25
    assert draw_chance("rrrr", 0.1) == 0.1 and draw_chance("wwww", 0.3) == 0.3


def test_the_decision_at_a_position_is_the_seeds_alone_and_uniform() -> None:
    draws = np.array([uniform(7, p) for p in range(20_000)])
    assert [uniform(7, p) for p in range(5)] == list(draws[:5])  # the same in every process and restart
    assert uniform(8, 0) != draws[0]
    assert 0.49 < draws.mean() < 0.51 and draws.min() >= 0 and draws.max() < 1
    assert abs((draws < 0.1).mean() - 0.1) < 0.01


def test_choose_takes_the_unseen_and_informative_and_passes_the_saturated_at_the_floor() -> None:
    positions = list(range(4_000))
    histories = ["", "mmmm", "rrrr", "wwww"] * 1_000
    ids = [str(p) for p in positions]
    draw = choose(positions, histories, 1, 0.1, ids, set())
    assert draw.pools_taken["unseen"] == 1_000 and draw.pools_taken["informative"] == 1_000
    assert "unseen" not in draw.pools_passed and "informative" not in draw.pools_passed
    quarter = choose(positions, ["mrrr"] * 4_000, 1, 0.1, ids, set())  # one informative group in four
    assert 900 <= quarter.pools_taken["informative"] <= 1_100
    for saturated in ("solved", "unsolved"):
        assert 70 <= draw.pools_taken[saturated] <= 130  # about a tenth: retried, never excluded
        assert draw.pools_taken[saturated] + draw.pools_passed[saturated] == 1_000
    assert draw == choose(positions, histories, 1, 0.1, ids, set())  # a function of the record and the seed
    again = choose([7, 8], ["", ""], 1, 0.1, ["a", "b"], {"a"})  # a problem already in the round is passed over
    assert again.taken == [1] and again.passed == [0]


def test_cursor_sampling_is_todays_order_exactly() -> None:
    task, record = addition_task(20, seed=3), Record()
    record.histories = {p.id: "rrrr" for p in task.train}  # a record, if there were one, changes nothing
    drawn = [p.id for _ in range(30) for p in source(record, task, "cursor").draw(8, "a").problems]
    assert drawn == [task.at(i).id for i in range(240)]
    assert record.choices == Counter()


def test_with_an_empty_record_difficulty_sampling_is_the_cursors_order() -> None:
    task, record = addition_task(20, seed=3), Record()
    assert [p.id for p in source(record, task).draw(16, "a").problems] == [task.at(i).id for i in range(16)]


def simulate(task: Task, sampling: str, informative: set[str], rounds: int, actors: int = 2) -> tuple[Record, list]:
    """Rounds of 8 by ``actors`` actors taking turns on one record; a problem in ``informative`` gives a mixed
    group, any other an all-wrong one. Returns the record and each round's problem ids."""
    record = Record()
    sources = [source(record, task, sampling) for _ in range(actors)]
    drawn = []
    for i in range(rounds):
        s = sources[i % actors]
        problems = s.draw(8, "a").problems
        s.record(problems, [[1.0, 0.0] if p.id in informative else [0.0, 0.0] for p in problems])
        drawn.append([p.id for p in problems])
    return record, drawn


def zero_std_share(rounds: list[list[str]], informative: set[str]) -> float:
    ids = [i for r in rounds for i in r]
    return sum(i not in informative for i in ids) / len(ids)


def test_difficulty_sampling_cuts_the_zero_std_share_and_starves_no_problem() -> None:
    task = addition_task(20, seed=3)  # 80 training problems
    learnable = {p.id for p in task.train[::2]}  # half teach something, half never do
    record, by_difficulty = simulate(task, "difficulty", learnable, rounds=100)
    _, by_cursor = simulate(task, "cursor", learnable, rounds=100)
    first_pass = 80 // 8
    assert zero_std_share(by_cursor[first_pass:], learnable) == pytest.approx(0.5, abs=0.02)
    assert zero_std_share(by_difficulty[:first_pass], learnable) == pytest.approx(0.5, abs=0.02)  # all unseen
    assert zero_std_share(by_difficulty[first_pass:], learnable) < 0.2  # then about 0.1 / 1.1
    # No problem starves: every one drawn, the hopeless ones again and again at the floor.
    assert set(record.histories) == {p.id for p in task.train}
    retried = [len(record.histories[p.id]) for p in task.train if p.id not in learnable]
    assert sum(n >= 2 for n in retried) >= len(retried) // 2
    assert record.choices["passed:unsolved"] > 5 * record.choices["taken:unsolved"] > 0


def test_a_problem_the_model_forgets_comes_back() -> None:
    task = addition_task(20, seed=3)
    record = Record()
    record.histories = {p.id: "rrrr" for p in task.train}  # every problem solved
    forgotten = task.train[5].id
    s = source(record, task)
    seen = []
    for _ in range(60):  # rounds of 8: until the forgotten one is drawn at the floor and found informative
        problems = s.draw(8, "a").problems
        s.record(problems, [[1.0, 0.0] if p.id == forgotten else [1.0, 1.0] for p in problems])
        seen += [p.id for p in problems]
    assert record.histories[forgotten].count("m") >= 1
    # Once informative again, it is drawn at every pass it reaches instead of one in ten.
    passes = record.cursor // len(task.train)
    assert seen.count(forgotten) >= passes // 3 >= 2


def test_no_two_actors_draw_the_same_problem_within_a_pass() -> None:
    task = addition_task(20, seed=3)
    learnable = {p.id for p in task.train[::3]}
    record, drawn = simulate(task, "difficulty", learnable, rounds=60, actors=3)
    n = len(task.train)
    # Each round's positions come from the shared cursor: a problem appears at most once per pass begun.
    begun = -(-record.cursor // n)
    assert max(Counter(i for r in drawn for i in r).values()) <= begun
    for r in drawn:
        assert len(set(r)) == len(r)  # nor one round the same problem twice, where it reaches into the next pass


def test_a_round_is_whole_even_when_every_problem_sits_at_the_floor() -> None:
    task = Task("t", [Problem(f"p{i}", f"{i}", "0") for i in range(10)], [], seed=0)
    record = Record()
    record.histories = {f"p{i}": "wwww" for i in range(10)}
    s = source(record, task, difficulty_floor=0.01)
    assert len(s.draw(8, "a").problems) == 8
    assert record.cursor <= position_cap(8, 0.01)
    assert position_cap(1, 0.1) == 220  # what keeps a short round's chance of falling short under 1e-6


def test_a_round_larger_than_the_training_set_repeats_problems_as_the_cursor_does() -> None:
    task = Task("t", [Problem(f"p{i}", f"{i}", "0") for i in range(3)], [], seed=0)
    record = Record()
    drawn = source(record, task).draw(8, "a").problems
    assert len(drawn) == 8 and {p.id for p in drawn} == {"p0", "p1", "p2"}
    assert record.cursor == 8  # every problem unseen: eight positions, no detour
