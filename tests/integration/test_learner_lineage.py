"""Staleness across a learner crash, measured: a real `grpo learner` is SIGKILLed after a step that no checkpoint
covers, and a new one resumes from the checkpoint before it. The groups of the lost step (still pending in Redis)
are trained again, and groups sampled with the dead learner's last weights (a branch no later policy descends from)
are dropped as ``lineage``, while the accounting balances."""

from __future__ import annotations

import json
import signal
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from common.children import wait_until
from common.config import RedisConfig
from common.schemas import decode_group, encode_group
from common.transport import Transport, read_balance
from tests.integration.test_learner_process import group

pytestmark = pytest.mark.integration


def stamped(tok, version: int, epoch: int | None) -> bytes:  # type: ignore[no-untyped-def]
    return encode_group(replace(decode_group(group(tok, version)), epoch=epoch))


def feed(t: Transport, tok, stop: threading.Event, min_epoch: int) -> None:  # type: ignore[no-untyped-def]
    """An actor's part: two groups whenever the learner has read what it had, stamped with the announced version
    and epoch (once the announced epoch is ``min_epoch``: the new learner's)."""
    while not stop.wait(0.05):
        ann = t.latest_weights()
        if ann is not None and ann.epoch >= min_epoch and t.unread() == 0:
            t.produce([stamped(tok, ann.version, ann.epoch) for _ in range(2)])


def test_a_killed_learners_lost_steps_are_trained_again_and_its_dead_branch_dropped(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    t = Transport(RedisConfig(url=redis_url), "lineage")
    run_dir = tmp_path / "run"
    settings = [
        f"redis.url={redis_url}", f"model.path={tiny_model_dir}", f"run.dir={run_dir}", "run.name=lineage",
        "run.steps=6", "learner.batch_groups=2", "sampling.group_size=4", "task.eval_size=2", "learner.eval_every=1000",
        "learner.max_staleness=1", "checkpoint.every=2",
        "run.lease_ttl_s=2",  # the second learner, started right after the kill, takes the run over within it
    ]  # fmt: skip
    args = [a for o in settings for a in ("-o", o)]

    # Steps 1-3, each on two groups of the version before it; step 2 is checkpointed, step 3 is not.
    t.produce([stamped(tok, v, 0) for v in (0, 0, 1, 1, 2, 2)])
    first = processes.grpo("learner", *args, log=tmp_path / "first.log")
    metrics = run_dir / "metrics.jsonl"
    assert wait_until(lambda: metrics.exists() and '"step": 3' in metrics.read_text(), 180), (
        tmp_path / "first.log"
    ).read_text()
    first.kill()
    assert first.wait() == -signal.SIGKILL
    assert t.latest_weights().version == 3 and read_balance(t).pending == 2  # step 3's groups: never acknowledged
    # Groups sampled with version 3, the killed learner's step 3: the resumed policy does not descend from it.
    t.produce([stamped(tok, 3, 0), stamped(tok, 3, None)])  # one from an actor of an earlier build (no stamp)

    stop = threading.Event()
    feeder = threading.Thread(target=feed, args=(t, tok, stop, 1), daemon=True)
    feeder.start()
    try:
        second = processes.grpo("learner", *args, log=tmp_path / "second.log")
        assert second.wait(timeout=180) == 0, (tmp_path / "second.log").read_text()
    finally:
        stop.set()
        feeder.join()
    log = (tmp_path / "second.log").read_text()
    assert "resumed from" in log and "continuing at version 4 (epoch 1, from step 2)" in log, log

    b = read_balance(t)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    print(b.equation(), b.dropped, [(r["step"], r["policy_version"], r.get("staleness/max")) for r in rows])
    assert [r["step"] for r in rows] == list(range(7))
    # The lost step 3 was trained again on its own groups (sampled with step 2's weights: 0 steps old); under
    # versions alone they were 4 - 2 = 2 versions old, past max_staleness, and dropped as stale.
    assert rows[3]["policy_version"] == 5 and rows[3]["staleness/max"] == 0
    assert b.dropped == {"lineage": 2}, b.equation()
    assert b.trained == 12 and rows[-1]["groups_consumed"] == 12 and b.unexplained == 0, b.equation()
    ann = t.latest_weights()
    assert (ann.version, ann.epoch) == (8, 1)
    t.close()


def test_a_learner_whose_checkpoints_are_another_runs_than_redis_holds_exits_2(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    """Two runs under one run.name (one Redis, two run directories): a user's mistake, one line and exit 2; the run
    Redis holds is left as it was."""
    from transformers import AutoTokenizer

    from tests.integration.test_learner_process import run_learner

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    t = Transport(RedisConfig(url=redis_url), "two")
    t.produce([group(tok, 0) for _ in range(2)])
    run_learner(processes, redis_url, tiny_model_dir, tmp_path, "two", 1)
    identity = t.identity()
    assert identity is not None
    mine = identity.id
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-000001" / "state.json").read_text())
    assert state["run_id"] == mine and state["epochs"] == [[0, 0, 0]]

    t.client.hset(t.keys.identity, "id", "another-run")
    # The other run's learner has read two groups and not settled them yet: they must stay its own.
    t.produce([group(tok, 0) for _ in range(2)])
    t.read("other-learner", 2, 0)
    settings = [f"redis.url={redis_url}", f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'run'}",
                "run.name=two", "run.steps=2", "learner.batch_groups=2", "sampling.group_size=4",
                "task.eval_size=2"]  # fmt: skip
    proc = processes.grpo("learner", *[a for o in settings for a in ("-o", o)], log=tmp_path / "second.log")
    assert proc.wait(timeout=180) == 2
    log = (tmp_path / "second.log").read_text()
    assert "Traceback" not in log and "Redis holds run another-run under run.name two" in log, log
    assert f"are run {mine}'s: give each run its own run.name" in log
    after = t.identity()
    assert after is not None and after.id == "another-run" and after.reset_at is None
    pending = t.client.xpending(t.keys.groups, "learners")
    assert pending["pending"] == 2 and [c["name"] for c in pending["consumers"]] == [b"other-learner"], pending
    t.close()
