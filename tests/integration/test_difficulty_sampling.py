"""Difficulty sampling end to end: two real `sim` actors on a real Redis draw from one record.

Half the training problems always give mixed rewards and half never a right answer (tests.graders_for_tests
:coin_or_never). Drawing by the cursor, half the groups sampled are zero-std and filtered; drawing by difficulty,
the hopeless half is passed over after the first pass but still retried at the floor, and no problem starves.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from common.children import wait_until
from common.config import RedisConfig, TaskConfig
from common.tasks import make_task
from common.transport import Transport
from tests.integration.test_actor_flow import sim_actor

pytestmark = pytest.mark.integration

PASSES = 6


def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "problems.jsonl"
    rows = [{"question": f"{i}+{i}=", "answer": "coin" if i % 2 else "never"} for i in range(44)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_two_actors(model: Path, tmp_path: Path, url: str, sampling: str, processes) -> tuple[Transport, int]:  # type: ignore[no-untyped-def]
    """Two actors until the cursor is ``PASSES`` passes in; returns the run's keys and its training size."""
    data = dataset(tmp_path)
    task = {"task.name": "dataset", "task.path": str(data), "task.eval_size": "4"}
    options = [f"{k}={v}" for k, v in task.items()] + [
        f"actor.prompt_sampling={sampling}", "actor.difficulty_window=64", "actor.filter_zero_std=true",
        "grader.name=tests.graders_for_tests:coin_or_never", "sampling.max_new_tokens=8",
        "actor.sim_tokens_per_s=4000", "actor.max_stream_groups=100000", "learner.max_staleness=100000",
    ]  # fmt: skip
    n = len(make_task(TaskConfig(name="dataset", path=str(data), eval_size=4), seed=0).train)
    t = Transport(RedisConfig(url=url), "it")
    procs = []
    for name in ("a", "b"):
        args = sim_actor(model, tmp_path / name, url, *options)
        args[args.index("actor.id=actor-it")] = f"actor.id=actor-{name}"
        procs.append(processes.grpo(*args, log=tmp_path / f"actor-{name}.log"))
    logs = lambda: "\n".join((tmp_path / f"actor-{x}.log").read_text() for x in "ab")  # noqa: E731
    assert wait_until(lambda: int(t.client.get(t.keys.prompts_cursor) or 0) >= PASSES * n, 180), logs()
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        assert p.wait(timeout=60) == 0, logs()
    return t, n


def zero_std_share(t: Transport) -> float:
    stats = t.stats()
    filtered = stats.get("groups_filtered:zero_std", 0)
    return filtered / (filtered + stats.get("groups_produced", 0))


def test_difficulty_sampling_filters_less_and_starves_no_problem(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    t, n = run_two_actors(tiny_model_dir, tmp_path, redis_url, "difficulty", processes)
    # After the first pass (every problem unseen: half filtered), a hopeless problem is drawn one time in ten:
    # about (n/2 + (PASSES - 1) * n/20) / (n + (PASSES - 1) * 0.55 n) = 0.24 of the groups are zero-std.
    assert zero_std_share(t) < 0.35
    histories = {k.decode(): v.decode() for k, v in t.client.hgetall(t.keys.prompts_record).items()}
    training = {p.id for p in make_task(TaskConfig(name="dataset", path=str(dataset(tmp_path)), eval_size=4), 0).train}
    assert set(histories) == training  # every problem drawn: none starved
    hopeless = [h for h in histories.values() if set(h) == {"w"}]
    assert len(hopeless) >= n // 2 - 2 and sum(len(h) >= 2 for h in hopeless) >= 3  # retried at the floor
    # Each pass reaches a problem once, and the two actors never drew the same one in it.
    assert max(len(h) for h in histories.values()) <= PASSES + 1
    _, choices = t.sampling_choices()
    assert choices["passed:unsolved"] > 4 * choices["taken:unsolved"] > 0


def test_cursor_sampling_filters_the_hopeless_half(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    t, _ = run_two_actors(tiny_model_dir, tmp_path, redis_url, "cursor", processes)
    assert zero_std_share(t) >= 0.45  # the baseline the test above beats
    assert t.sampling_choices() == (0, {})  # the cursor keeps no record
