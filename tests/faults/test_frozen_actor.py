"""An actor frozen past its lease, for real: a `grpo learner` and two `grpo actor` processes on a real redis-server.
The test SIGSTOPs one actor while it holds a claim on the prompt positions of the round it samples, waits until the
other actor's draw has given those positions back and taken them, and wakes it.

Then: the woken actor's round is refused whole and discarded, counted (``groups_discarded:claim_lost``), instead of
repeating prompts another actor sampled; it goes on sampling; the run finishes every step; the groups' and the
prompts' equations balance, and no position was trained twice."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from common.children import wait_until
from common.config import RedisConfig
from common.transport import Transport, read_balance
from tests.faults.runs import run_settings
from tests.faults.test_faults import _tail

pytestmark = [pytest.mark.faults, pytest.mark.slow]

STEPS = 16
BATCH = 4


def test_an_actor_frozen_past_its_lease_loses_its_round_not_its_prompts(demo_model_dir: Path, redis_url: str,
                                                                         tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    # Zero-std groups sent too: every round sends groups, so that the refused round is one with groups in it.
    args = run_settings(redis_url, demo_model_dir, run_dir, "frozen-actor", STEPS, BATCH, "checkpoint.every=2",
                        "actor.filter_zero_std=false", "learner.min_step_s=0.5")  # fmt: skip
    t = Transport(RedisConfig(url=redis_url), "frozen-actor")
    learner = processes.grpo("learner", *args, log=logs / "learner.log")
    frozen = processes.grpo("actor", *args, "-o", "actor.id=frozen", log=logs / "frozen.log")
    other = processes.grpo("actor", *args, "-o", "actor.id=other", log=logs / "other.log")

    def lost() -> int:
        return t.prompt_balance().counters.requeued.get("lost", 0)

    assert wait_until(lambda: (a := t.latest_weights()) is not None and a.version >= 2, 240), _tail(logs)
    assert wait_until(lambda: "frozen" in t.prompt_balance().claims, 60, interval_s=0.01), _tail(logs)
    frozen.send_signal(signal.SIGSTOP)  # holding a claim: its round is being sampled
    try:
        # Past its lease (run.heartbeat_ttl_s), the other actor's next draw gives its positions back and takes them.
        assert wait_until(lambda: lost() > 0, 120), _tail(logs)
    finally:
        frozen.send_signal(signal.SIGCONT)
    assert learner.wait(timeout=300) == 0, _tail(logs)
    assert frozen.wait(timeout=60) == 0 and other.wait(timeout=60) == 0, _tail(logs)

    text = (logs / "frozen.log").read_text()
    assert "other actors draw its prompts again" in text and "Traceback" not in text, text[-3000:]
    b, pb = read_balance(t), t.prompt_balance()
    assert b.discarded.get("claim_lost", 0) > 0, b.discarded
    assert b.unexplained == 0 and b.trained == STEPS * BATCH, b.equation()
    assert pb.unexplained == 0 and pb.counters.redrawn >= lost() > 0, pb.equation()
    assert pb.counters.trained == b.trained and pb.counters.retrained == 0, pb.counters


def test_of_two_actors_under_one_id_the_newer_samples_and_the_woken_one_stops(demo_model_dir: Path, redis_url: str,
                                                                              tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]  # fmt: skip
    """Two processes under one ``actor.id``: each new round of either gave back the other's live claim, so neither
    sent. A process frozen past its heartbeat and lease is replaced: the newer one takes the id once the frozen one's
    heartbeat has lapsed and samples; the frozen one, woken, is refused its next draw and stops (exit 5, one line).
    A third process configured with the same id while the newer one lives waits for it, disturbing nothing. The run
    finishes with both equations balanced."""
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    args = run_settings(redis_url, demo_model_dir, run_dir, "twin-actors", STEPS, BATCH, "learner.min_step_s=0.5",
                        "actor.filter_zero_std=false", "actor.id=twin")  # fmt: skip
    t = Transport(RedisConfig(url=redis_url), "twin-actors")
    learner = processes.grpo("learner", *args, log=logs / "learner.log")
    frozen = processes.grpo("actor", *args, log=logs / "frozen.log")
    assert wait_until(lambda: (a := t.latest_weights()) is not None and a.version >= 2, 240), _tail(logs)
    frozen.send_signal(signal.SIGSTOP)
    try:
        newer = processes.grpo("actor", *args, log=logs / "newer.log")
        assert wait_until(lambda: t.client.hget(t.keys.actor_ids, "twin") == b"2", 120), _tail(logs)
        sent = t.prompt_balance().counters.sent
        assert wait_until(lambda: t.prompt_balance().counters.sent > sent, 120), _tail(logs)  # the newer one sends
        third = processes.grpo("actor", *args, log=logs / "third.log")
        assert wait_until(lambda: "actor.id twin is taken" in (logs / "third.log").read_text(), 120), _tail(logs)
    finally:
        frozen.send_signal(signal.SIGCONT)
    assert frozen.wait(timeout=120) == 5, _tail(logs)
    assert learner.wait(timeout=300) == 0 and newer.wait(timeout=60) == 0 and third.wait(timeout=60) == 0, _tail(logs)

    text = (logs / "frozen.log").read_text()
    assert "stopped: a newer process took actor id twin" in text and "Traceback" not in text, text[-3000:]
    b, pb = read_balance(t), t.prompt_balance()
    assert b.unexplained == 0 and b.trained == STEPS * BATCH, b.equation()
    assert pb.unexplained == 0 and not pb.claims and pb.counters.retrained == 0, pb.equation()
