"""common.tasks: the addition split, the shared cursor's order, and the held-out size checked."""

from __future__ import annotations

import pytest

from common.tasks import addition_task


def test_addition_split_is_disjoint_and_deterministic() -> None:
    a, b = addition_task(20, seed=1), addition_task(20, seed=1)
    assert [p.id for p in a.eval] == [p.id for p in b.eval]
    assert len(a.eval) == 20 and len(a.train) == 80
    assert not {p.prompt for p in a.eval} & {p.prompt for p in a.train}
    p = next(p for p in a.all if p.id == "add-7-8")
    assert (p.prompt, p.reference) == ("7+8=", "15")
    assert [p.id for p in addition_task(20, seed=2).eval] != [p.id for p in a.eval]


def test_cursor_positions_cover_each_pass_once_in_the_same_order_everywhere() -> None:
    a, b = addition_task(20, seed=0), addition_task(20, seed=0)
    first_pass = [a.at(i).id for i in range(80)]
    assert sorted(first_pass) == sorted(p.id for p in a.train)  # every training prompt once per pass
    assert [b.at(i).id for i in range(80)] == first_pass  # another replica agrees
    second = [a.at(i).id for i in range(80, 160)]
    assert sorted(second) == sorted(first_pass) and second != first_pass  # reshuffled each pass


def test_eval_size_is_validated() -> None:
    with pytest.raises(ValueError):
        addition_task(100)
