"""Held-out evaluation counts an answer right by the grader's notion of correct, not by a perfect training reward."""

from __future__ import annotations

from common.config import load_config
from common.tasks.evaluation import correctness, summarise
from grader.pool import GraderPool

COMBINE = ["grader.name=combine", "grader.components=[{name: gsm8k, weight: 0.9}, {name: format, weight: 0.1}]"]


def scores(grader, pairs: list[tuple[str, str]]) -> list[float]:  # type: ignore[no-untyped-def]
    return GraderPool(grader.spec(), isolation="inline").grade(pairs).scores


def test_with_combine_a_right_answer_without_the_format_bonus_counts_as_right() -> None:
    cfg = load_config(overrides=COMBINE, env={}).grader
    pairs = [("The answer is 8.", "8"), ("<think>3+5</think><answer>8</answer>", "8"), ("It is 9.", "8")]
    assert scores(cfg, pairs) == [0.9, 1.0, 0.0]  # the training reward: correctness plus a layout bonus
    right = scores(correctness(cfg), pairs)
    assert right == [1.0, 1.0, 0.0]
    assert summarise(right, [[], [], []])["pass_at_1"] == 2 / 3  # a perfect reward alone would count 1 of 3


def test_every_answer_checking_component_must_agree() -> None:
    cfg = load_config(
        overrides=["grader.name=combine", "grader.components=[{name: gsm8k, weight: 2}, {name: exact, weight: 1}]"],
        env={},
    ).grader
    assert correctness(cfg) == cfg
    assert scores(correctness(cfg), [("8", "8"), ("#### 8", "8")]) == [1.0, 2 / 3]


def test_other_graders_are_their_own_notion_of_correct() -> None:
    for overrides in (["grader.name=gsm8k"], ["grader.name=combine", "grader.components=[{name: format}]"]):
        cfg = load_config(overrides=overrides, env={}).grader
        assert correctness(cfg) == cfg
