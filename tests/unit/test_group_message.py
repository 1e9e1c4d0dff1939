"""A group's message from the actor's round (actor.message): which version it carries, and which completions need
their (version, tokens) runs, so that no token is taken for newer than the weights that produced it."""

from __future__ import annotations

from actor.message import group_message
from common.rollout import Sample
from common.schemas import decode_group, encode_group
from common.tasks import Problem


def message(samples: list[Sample], version_sampled: int = 3):  # type: ignore[no-untyped-def]
    msg = group_message(Problem("p", "q", "1"), [5, 6], samples, [1.0] * len(samples), None, forwarded=False,
                        actor_id="a", version_sampled=version_sampled, epochs={})  # fmt: skip
    return decode_group(encode_group(msg))  # and it travels


def runs(msg) -> list[list[list[int]] | None]:  # type: ignore[no-untyped-def]
    return [None if c.runs is None else c.runs.tolist() for c in msg.completions]


def test_a_completion_that_says_nothing_beside_one_that_moved_on_keeps_its_older_version() -> None:
    # One answer sampled whole at version 3 (no runs), another moved on to 4 mid-answer (in-flight updates).
    msg = message([Sample([1, 2, 3], [0.0] * 3, "stop"), Sample([1, 2, 3], [0.0] * 3, "stop", ((3, 2), (4, 1)))])
    assert msg.policy_version == 4
    assert runs(msg) == [[[3, 3]], [[3, 2], [4, 1]]]  # not None: its tokens are 3's, not the group's 4


def test_episodes_each_of_one_version_but_not_the_same_keep_their_runs() -> None:
    # SGLang serving a LoRA adapter updates whole requests: each episode one run, one older than the other.
    msg = message([Sample([1, 2], [0.0] * 2, "stop", ((4, 2),)), Sample([1, 2, 3], [0.0] * 3, "stop", ((5, 3),))])
    assert msg.policy_version == 5 and runs(msg) == [[[4, 2]], [[5, 3]]]


def test_runs_are_left_out_only_where_every_completion_is_one_run_of_the_groups_version() -> None:
    msg = message([Sample([1, 2], [0.0] * 2, "stop", ((4, 2),)), Sample([1], [0.0], "stop")], version_sampled=4)
    assert msg.policy_version == 4 and runs(msg) == [None, None]
    assert message([Sample([1], [0.0], "stop")]).policy_version == 3  # no runs anywhere: the round's version
