"""Groups actors filter out count in the learner's reward figures even when no group they sent survives: they are
summed in Redis by the script that writes the round, not carried by the next group sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import RedisConfig
from common.procs import wait_until
from common.schemas import FilteredStats, decode_group
from common.transport import Transport, read_balance
from tests.integration.test_actor_flow import sim_actor
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
    stats, totals = t.stats(), t.filtered_totals()  # the same script wrote both, whenever this reads them
    assert totals.groups == stats["groups_filtered:zero_std"]
    assert totals.completions == 8 * totals.groups and totals.zero_std_groups == totals.groups
    # The groups sent carry no summary: dropping one loses nothing.
    for _, f in t.client.xrange(t.keys.groups):
        assert decode_group(f[b"data"]).filtered == FilteredStats()
