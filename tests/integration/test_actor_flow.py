"""A real `sim` actor process on a real Redis: how it waits for room, heartbeats and stops, round by round."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from common.children import wait_until
from common.config import RedisConfig
from common.schemas import decode_group
from common.transport import Transport
from tests.integration.test_actor_process import actor_args

pytestmark = pytest.mark.integration


def sim_actor(model: Path, run_dir: Path, url: str, *extra: str) -> list[str]:
    """An actor with the `sim` engine: random completions at ``actor.sim_tokens_per_s`` (a round's length is set by
    that rate), graded in-process, none filtered."""
    sim = ["actor.engine=sim", "actor.filter_zero_std=false", "grader.isolation=inline", *extra]
    return actor_args(model, run_dir, url, *[a for o in sim for a in ("-o", o)])


def cursor(t: Transport) -> int:
    return int(t.client.get(t.keys.prompts_cursor) or 0)


def actor_groups(t: Transport) -> list:  # type: ignore[type-arg]
    return [decode_group(f[b"data"]) for _, f in t.client.xrange(t.keys.groups) if f[b"data"] != b"foreign"]


def test_a_round_larger_than_the_bound_is_sent_once_the_stream_empties(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    t = Transport(RedisConfig(url=redis_url), "it")
    # Rounds of 4 groups, at most 2 unread: a round fits only an empty stream, as the write script admits it.
    args = sim_actor(tiny_model_dir, tmp_path, redis_url, "actor.max_stream_groups=2", "actor.sim_tokens_per_s=40")
    processes.grpo(*args, log=tmp_path / "actor.log")
    # While the actor samples its first round (about 2 s), another writer leaves one group in the stream: the
    # round is refused when it is done and waits for room.
    assert wait_until(lambda: cursor(t) >= 4, 120), (tmp_path / "actor.log").read_text()
    t.produce([b"foreign"])
    time.sleep(6)
    assert actor_groups(t) == []
    # The stream empties (the group is read and settled): the whole round goes in.
    t.client.delete(t.keys.groups)
    assert wait_until(lambda: len(actor_groups(t)) == 4, 30), (tmp_path / "actor.log").read_text()


def test_the_heartbeat_outlives_a_round_longer_than_its_ttl(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    t = Transport(RedisConfig(url=redis_url), "it")
    # A round of about 80 tokens at 8 tokens/s: 10 s of sampling, against a heartbeat TTL of 3 s.
    args = sim_actor(tiny_model_dir, tmp_path, redis_url, "actor.sim_tokens_per_s=8")
    processes.grpo(*args, log=tmp_path / "actor.log")
    assert wait_until(lambda: cursor(t) >= 4, 120), (tmp_path / "actor.log").read_text()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 8:
        assert "actor-it" in t.live_actors(), f"the key expired {time.monotonic() - t0:.1f}s into the round"
        assert actor_groups(t) == []  # still sampling the first round
        time.sleep(0.25)


def test_the_actor_samples_only_what_the_learner_can_train_before_it_is_stale(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.weights import publish

    t = Transport(RedisConfig(url=redis_url), "it")
    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    t.announce_weights(publish(model, tok, tmp_path / "weights", 0, keep=2).announcement)
    # Batches of 8 and no staleness allowed: only the next batch can be trained with version 0. The stream's own
    # bound (16 unread) would admit twice that, and the second half would be dropped as stale.
    args = sim_actor(tiny_model_dir, tmp_path, redis_url, "learner.max_staleness=0")
    processes.grpo(*args, log=tmp_path / "actor.log")
    assert wait_until(lambda: t.stream_length() >= 8, 120), (tmp_path / "actor.log").read_text()
    time.sleep(3)
    assert t.stream_length() == 8
    assert cursor(t) == 8  # and it sampled no more than it sent


def _hold_a_round_in_a_full_stream(tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes, *extra: str):  # type: ignore[no-untyped-def]
    """An actor whose sampled round finds the stream full: another writer filled it while the round was sampled."""
    t = Transport(RedisConfig(url=redis_url), "it")
    args = sim_actor(tiny_model_dir, tmp_path, redis_url, "actor.max_stream_groups=4", "actor.sim_tokens_per_s=40",
                     *extra)  # fmt: skip
    proc = processes.grpo(*args, log=tmp_path / "actor.log")
    assert wait_until(lambda: cursor(t) >= 4, 120), (tmp_path / "actor.log").read_text()
    t.produce([b"foreign"] * 4)
    time.sleep(5)  # the round (about 2 s of sampling) is done and waits for room
    assert actor_groups(t) == [] and proc.poll() is None
    return t, proc


def test_a_stopped_actor_waits_for_room_and_sends_its_round_whole(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    t, proc = _hold_a_round_in_a_full_stream(tiny_model_dir, redis_url, tmp_path, processes)
    proc.send_signal(signal.SIGTERM)
    time.sleep(3)
    assert proc.poll() is None, "the actor gave up its round"
    t.client.delete(t.keys.groups)  # the learner makes room
    assert proc.wait(timeout=30) == 0
    assert len(actor_groups(t)) == 4
    assert t.stats()["groups_produced"] == 4 + 4


def test_a_stopped_actor_that_never_gets_room_counts_the_round_it_discards(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    t, proc = _hold_a_round_in_a_full_stream(
        tiny_model_dir, redis_url, tmp_path, processes, "actor.stop_send_timeout_s=2"
    )
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert time.monotonic() - t0 >= 2
    assert actor_groups(t) == []
    assert t.stats()["groups_discarded:stopped"] == 4
    assert "discarding a round of 4 groups: stopped" in (tmp_path / "actor.log").read_text()
