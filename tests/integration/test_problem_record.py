"""The run's problem record (common.transport.difficulty) on a real Redis: the script keeps each history's newest
outcomes, counts the choices, and what another writer left in the keys is read for what it holds."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from actor.difficulty import appended
from actor.prompts import PromptSource
from common.config import Config, RedisConfig
from common.metrics import ActorMetrics
from common.tasks import addition_task
from common.transport import Transport

pytestmark = pytest.mark.integration


def transport(url: str) -> Transport:
    return Transport(RedisConfig(url=url, retries=1), "pr")


def test_histories_keep_the_newest_outcomes_and_the_choices_add_up(redis_url: str) -> None:
    t = transport(redis_url)
    assert t.histories(["a", "b"], 4) == ["", ""]
    expected = {"a": "", "b": ""}
    for i, (a, b) in enumerate(["mr", "rr", "rw", "rw", "mw", "rr"]):
        t.record_outcomes([("a", a), ("b", b)], 4, {"taken:unseen": 2 if i == 0 else 0, "taken:solved": 1})
        expected = {"a": appended(expected["a"], a, 4), "b": appended(expected["b"], b, 4)}
    assert t.histories(["a", "b", "c"], 4) == [expected["a"], expected["b"], ""] == ["rrmr", "wwwr", ""]
    assert t.histories(["a"], 2) == ["mr"]  # a shorter window reads the newest
    assert t.sampling_choices() == (2, {"taken:unseen": 2, "taken:solved": 6})
    t.record_outcomes([], 4, {})  # nothing to write: no call
    assert t.sampling_choices()[0] == 2


def test_what_another_writer_left_is_read_for_what_it_holds(redis_url: str) -> None:
    t = transport(redis_url)
    t.client.hset(t.keys.prompts_record, mapping={"a": "zzmr\xffw" + "m" * 100, "b": b"\xff\xfe"})
    t.client.hset(t.keys.prompts_choices, mapping={"taken:unseen": 3, "passed:solved": "lots"})
    assert t.histories(["a", "b"], 4) == ["mmmm", ""]
    assert t.sampling_choices() == (2, {"taken:unseen": 3})


def test_a_record_key_of_another_type_makes_the_actor_draw_in_cursor_order(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    t = transport(redis_url)
    t.client.set(t.keys.prompts_record, "not a hash")
    cfg = Config.model_validate({"actor": {"prompt_sampling": "difficulty"}, "run": {"seed": 0}})
    task = addition_task(20, seed=0)
    s = PromptSource(cfg, task, t, ActorMetrics(CollectorRegistry()))
    with caplog.at_level(logging.WARNING):
        first = s.draw(4, "a").problems
        s.record(first, [[1.0, 0.0]] * 4)
        second = s.draw(4, "b").problems  # (another round: the first one still holds its positions)
    assert [p.id for p in first + second] == [task.at(i).id for i in range(8)]
    assert sum("cannot be used" in r.message for r in caplog.records) == 1  # said once
    assert t.client.get(t.keys.prompts_record) == b"not a hash"  # and left as it was
