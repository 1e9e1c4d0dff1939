"""Groups actors filter out count in the learner's reward figures even when no group they sent survives: they are
summed in Redis by the script that writes the round, not carried by the next group sent."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from common.children import wait_until
from common.config import RedisConfig
from common.grpo import is_zero_std, overlong_penalty
from common.schemas import FilteredStats, decode_group
from common.transport import Transport, read_balance
from tests.integration.test_actor_flow import actor_groups, sim_actor
from tests.integration.test_learner_process import group, run_learner

pytestmark = pytest.mark.integration


def test_filtered_groups_count_in_the_step_even_when_the_group_sent_with_them_is_dropped(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    t = Transport(RedisConfig(url=redis_url), "flt")
    # A round of 7 groups: 6 all right (filtered out), and one sent that the learner drops (from a future version).
    t.produce([group(tok, 9)], {"groups_filtered:zero_std": 6}, filtered=FilteredStats(6, 6, 24, 24.0, 0.0))
    t.produce([group(tok, 0), group(tok, 0)])  # half right each
    run_learner(processes, redis_url, tiny_model_dir, tmp_path, "flt", 1)

    assert read_balance(t).dropped == {"future": 1}
    row = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][1]
    assert row["groups_sampled"] == 8
    assert row["frac_reward_zero_std"] == pytest.approx(6 / 8)
    assert row["reward"] == pytest.approx((4 + 24) / (8 + 24))
    assert row["reward/trained"] == pytest.approx(0.5)


def test_an_actor_counts_what_it_filters_in_redis_as_it_writes_each_round(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    t = Transport(RedisConfig(url=redis_url), "it")
    # Random answers score 0: nearly every group has all-equal rewards and is filtered, every fourth one sent flagged.
    args = sim_actor(
        tiny_model_dir, tmp_path, redis_url, "actor.filter_zero_std=true", "actor.max_consecutive_filtered=3"
    )
    processes.grpo(*args, log=tmp_path / "actor.log")
    assert wait_until(lambda: t.stats().get("groups_filtered:zero_std", 0) >= 6, 120), (
        tmp_path / "actor.log"
    ).read_text()
    # The same script wrote both: read in one transaction they agree, whenever this reads them (read one after the
    # other, the running actor's next round can land between the two reads).
    pipe = t.client.pipeline(transaction=True)
    stats_raw, filtered_raw = pipe.hgetall(t.keys.stats).hgetall(t.keys.filtered).execute()
    totals = FilteredStats.from_fields({k.decode(): float(v) for k, v in filtered_raw.items()})
    assert totals.groups == int(stats_raw[b"groups_filtered:zero_std"])
    assert totals.completions == 8 * totals.groups and totals.zero_std_groups == totals.groups
    # The groups sent carry no summary (the wire has no field for it): dropping one loses nothing.
    for _, f in t.client.xrange(t.keys.groups):
        assert "filtered" not in msgpack.unpackb(f[b"data"]) and decode_group(f[b"data"]).group_id


def test_an_actor_computes_the_overlong_penalty_once_filters_on_it_and_sends_it(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    """Random answers score 0, so every group's grader rewards are all equal; with the overlong penalty on, a group
    whose completions' lengths differ inside the penalty's window carries a signal and is sent, and only the others
    are filtered. What a group carries is the penalty of its own lengths, which the learner adds as it is."""
    t = Transport(RedisConfig(url=redis_url), "it")
    # No learner reads: the actor stops once the stream holds actor.max_stream_groups unread groups. At the default
    # 16 it stopped, about one run in 150, before filtering two groups (a group is filtered with chance 5/16), and
    # the wait below ran out: room for many more rounds, so that the actor goes on until both counts are reached.
    args = sim_actor(tiny_model_dir, tmp_path, redis_url, "actor.filter_zero_std=true",
                     "actor.max_consecutive_filtered=1000", "sampling.max_new_tokens=8", "sampling.group_size=2",
                     "shaping.overlong_cache=4", "shaping.overlong_factor=0.5", "actor.max_stream_groups=100000",
                     "run.log_level=DEBUG")  # fmt: skip
    processes.grpo(*args, log=tmp_path / "actor.log")
    assert wait_until(lambda: t.stream_length() >= 4 and t.stats().get("groups_filtered:zero_std", 0) >= 2, 120), (
        tmp_path / "actor.log"
    ).read_text()
    for msg in actor_groups(t):
        lengths = [len(c.token_ids) for c in msg.completions]
        assert msg.penalties is not None
        assert msg.penalties.tolist() == pytest.approx(overlong_penalty(lengths, 8, 4, 0.5))
        assert set(msg.rewards) == {0.0} and not is_zero_std(msg.rewards + msg.penalties)  # sent for its penalties
        assert not msg.zero_std
