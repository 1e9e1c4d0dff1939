"""Memory bounded by bytes, on a real Redis: an oversized message is refused when written and dead-lettered (a
prefix kept) without leaving Redis when met; reads stop at a byte budget; a restart takes over pending entries by id
and reads them a page at a time; a truncated dead letter is not replayed."""

from __future__ import annotations

import pytest

from common.config import RedisConfig, load_config
from common.model.limits import message_byte_limit
from common.transport import DEAD_PREFIX_BYTES, MessageTooLarge, ReadLimits, Transport, read_balance

pytestmark = pytest.mark.integration

MB = 2**20
LIMITS = ReadLimits(max_bytes=1 * MB, budget_bytes=2 * MB)


def transport(url: str) -> Transport:
    t = Transport(RedisConfig(url=url), "bytes")
    t.ensure_consumer_group()
    return t


def test_an_oversized_round_is_refused_whole_when_written(redis_url: str) -> None:
    t = transport(redis_url)
    with pytest.raises(MessageTooLarge, match=f"over the limit of {MB}"):
        t.produce([b"small", b"x" * (MB + 1)], {"groups_filtered:zero_std": 1}, max_bytes=MB)
    assert t.stream_length() == 0 and t.stats() == {}  # nothing written, nothing counted
    assert t.produce([b"x" * MB], max_bytes=MB) is not None


def test_an_oversized_entry_is_dead_lettered_with_a_prefix_without_being_read(redis_url: str) -> None:
    t = transport(redis_url)
    big = b"\x81" + b"y" * (5 * MB)
    t.produce([b"a", big, b"b"])  # written by something that does not check
    got = t.read("l", 10, 100, LIMITS)
    assert [e.payload for e in got] == [b"a", b"b"]
    ((dead_id, reason),) = got.dead
    assert reason.startswith(f"oversized: {len(big)} bytes, over the limit of {MB}")
    ((_, fields),) = t.client.xrange(t.keys.dead)
    assert fields[b"payload"] == big[:DEAD_PREFIX_BYTES] and int(fields[b"size"]) == len(big)
    assert fields[b"truncated"] == b"1" and fields[b"source_id"].decode() == dead_id
    assert t.client.memory_usage(t.keys.dead) < 64 * 1024
    b = read_balance(t)
    assert (b.dead, b.in_stream, b.unexplained) == (1, 2, 0)
    # Replaying it would put a prefix back where a group was: refused, and it stays a dead letter.
    (letter,) = t.dead_letters(1)
    with pytest.raises(ValueError, match="only the first 4096 bytes of an oversized message"):
        t.replay_dead(letter.id)
    assert t.client.xlen(t.keys.dead) == 1


def test_a_read_stops_at_its_byte_budget(redis_url: str) -> None:
    t = transport(redis_url)
    t.produce([bytes([i]) * (MB - 100) for i in range(8)])  # eight entries just under the limit
    sizes = []
    while got := t.read("l", 8, 0, LIMITS):
        sizes.append(len(got))
    assert sizes == [3, 3, 2]  # each read stops once it holds the 2 MB budget


def test_a_restart_takes_over_pending_entries_by_id_and_reads_them_in_pages(redis_url: str) -> None:
    t = transport(redis_url)
    t.produce([bytes([i]) * (3 * MB // 4) for i in range(10)] + [b"z" * (3 * MB)])
    assert len(t.read("dead-learner", 20, 0)) == 11  # read, never settled: the learner died
    ids = t.claim_pending("new-learner")
    assert len(ids) == 11 and all(isinstance(i, str) for i in ids)
    backlog = t.stranded("new-learner", set())
    pages, dead = [], []
    while backlog:
        got = t.fetch("new-learner", backlog, 10, LIMITS)
        backlog = backlog[got.taken :]
        pages.append(len(got))
        dead += got.dead
    assert pages == [3, 3, 3, 1] and len(dead) == 1  # a page stops once it holds 2 MB; the oversized one is dead
    assert read_balance(t).unexplained == 0


def test_the_default_limit_follows_the_models_limits(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    from common.model.loading import max_positions

    cfg = load_config(None, [f"model.path={tiny_model_dir}", "sampling.max_new_tokens=64"], env={})
    positions = max_positions(str(tiny_model_dir))
    assert positions
    g = cfg.sampling.group_size
    assert message_byte_limit(cfg) == 2 * (12 * (positions + g * 64) + 64 * g) + 64 * 1024
    set_by_hand = load_config(None, [f"model.path={tiny_model_dir}", "redis.max_message_bytes=5000"], env={})
    assert message_byte_limit(set_by_hand) == 5000


def test_a_live_learner_dead_letters_an_oversized_entry_and_trains_on(
    tiny_model_dir, redis_url: str, tmp_path, processes
) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from tests.integration.test_learner_process import group, run_learner

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    t = Transport(RedisConfig(url=redis_url), "big")
    t.produce([group(tok, 0), b"\x81" + b"y" * (4 * MB), group(tok, 0)])
    run_learner(processes, redis_url, tiny_model_dir, tmp_path, "big", 1, f"redis.max_message_bytes={MB}")
    b = read_balance(t)
    assert (b.trained, b.dead, b.unexplained) == (2, 1, 0)
    ((_, fields),) = t.client.xrange(t.keys.dead)
    assert fields[b"reason"].startswith(b"oversized: ") and len(fields[b"payload"]) == DEAD_PREFIX_BYTES
    assert "oversized" in (tmp_path / "learner.log").read_text()


def test_grpo_dead_refuses_to_replay_a_truncated_letter(redis_url: str) -> None:
    from tests.integration.test_ops import grpo

    t = Transport(RedisConfig(url=redis_url), "ops")  # the run `grpo` is pointed at
    t.ensure_consumer_group()
    t.produce([b"y" * (2 * MB)])
    assert len(t.read("l", 1, 0, LIMITS).dead) == 1
    (letter,) = t.dead_letters(1)
    listed = grpo(redis_url, "dead")
    assert f"{2 * MB:>8} B  oversized" in listed.stdout, listed.stdout
    replayed = grpo(redis_url, "dead", "--replay", letter.id)
    assert replayed.returncode == 1
    assert f"{letter.id}: it holds only the first 4096 bytes of an oversized message" in replayed.stderr
    assert t.client.xlen(t.keys.dead) == 1 and t.stream_length() == 0
