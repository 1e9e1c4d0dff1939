"""A real `grpo learner` process on a real Redis, fed by the test: it trains on valid groups, drops stale and future
ones, dead-letters malformed messages with their reason, and the accounting balances."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import msgpack
import numpy as np
import pytest

from common.children import wait_until
from common.config import RedisConfig
from common.schemas import READABLE_VERSIONS, Completion, GroupMessage, decode_group, encode_group
from common.transport import Transport, read_balance

pytestmark = pytest.mark.integration

DESIGN_KEYS = {
    "step", "policy_version", "reward", "reward_std", "frac_reward_zero_std", "reward/trained",
    "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy", "completions/mean_length",
    "staleness/mean", "staleness/max", "loss", "lr", "groups_consumed", "time/step_s",
}  # fmt: skip


def group(tok, version: int, group_size: int = 4, all_right: bool = False) -> bytes:  # type: ignore[no-untyped-def]
    prompt = tok("3+5=").input_ids
    eos = tok.eos_token_id
    answers = [[tok.convert_tokens_to_ids("8"), eos], [tok.convert_tokens_to_ids("9"), eos]]
    comps = tuple(
        Completion(
            np.array(answers[i % 2], np.int32),
            np.array([-0.7, -0.2], np.float32),
            float(all_right or i % 2 == 0),
            "stop",
        )
        for i in range(group_size)
    )
    return encode_group(GroupMessage("add-3-5", version, "test", np.array(prompt, np.int32), comps))


def run_learner(processes, url: str, model: Path, tmp: Path, run: str, steps: int, *overrides: str) -> None:  # type: ignore[no-untyped-def]
    """A learner over the test's own groups (2 per step, groups of 4); returns when it has finished, exit 0."""
    settings = [
        f"redis.url={url}",
        f"model.path={model}",
        f"run.dir={tmp / 'run'}",
        f"run.name={run}",
        f"run.steps={steps}",
        "learner.batch_groups=2",
        "sampling.group_size=4",
        "task.eval_size=5",
        *overrides,
    ]
    args = [a for o in settings for a in ("-o", o)]
    proc = processes.grpo("learner", *args, log=tmp / "learner.log")
    assert proc.wait(timeout=180) == 0, (tmp / "learner.log").read_text()


def garbage(i: int) -> bytes:
    kinds = [
        b"\x00\xff not msgpack",
        msgpack.packb({"v": 99}),
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"v": 1, "type": "group"}),
        b"",
    ]
    return kinds[i % len(kinds)]


def test_learner_trains_drops_and_dead_letters(tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    t = Transport(RedisConfig(url=redis_url), "lt")
    # Steps 1-2 train four version-0 groups; at step 3 (learner version 2, max_staleness 1) two more version-0 groups
    # are too stale and one from version 9 is from the future; version-2 groups fill steps 3 and 4.
    payloads = [group(tok, v) for v in [0] * 4 + [0] * 2 + [9] + [2] * 4]
    payloads.insert(1, payloads[0])  # delivered twice (a retried write): trained once
    mixed: list[bytes] = []
    for i, p in enumerate(payloads):
        mixed += [garbage(3 * i), garbage(3 * i + 1), garbage(3 * i + 2), p]  # every one read before its group
    too_big = GroupMessage("x", 0, "test", np.array([1, 50_000], np.int32), decode_group(group(tok, 0)).completions)
    t.produce([encode_group(too_big), *mixed])  # valid on the wire, but not for this model's vocabulary
    t.produce([group(tok, 0, group_size=3)])  # a valid message with the wrong group size for this run
    run_dir = tmp_path / "run"
    run_learner(
        processes, redis_url, tiny_model_dir, tmp_path, "lt", 4, "learner.max_staleness=1", "learner.eval_every=2"
    )

    b = read_balance(t)
    assert b.trained == 8
    assert b.dead == 3 * len(payloads) + 1
    assert b.dropped == {"stale": 2, "future": 1, "duplicate": 1, "group_size": 1} or (
        # the wrong-size group sits last in the stream: the learner may finish before reading it
        b.dropped == {"stale": 2, "future": 1, "duplicate": 1} and b.in_stream == 1
    )
    assert b.unexplained == 0
    dead = t.client.xrange(t.keys.dead)
    assert len(dead) == b.dead
    reasons = {f[b"reason"].decode().split(":")[0] for _, f in dead}
    readable = ", ".join(map(str, READABLE_VERSIONS))  # the reason names every version this build reads
    assert {"not msgpack", f"unsupported schema version 99 (this build reads {readable})", "group"} <= reasons
    assert any("outside the model's vocabulary" in f[b"reason"].decode() for _, f in dead)
    assert all(b"payload" in f for _, f in dead)
    assert t.is_done()

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[2] and "eval/accuracy" in rows[4]
    assert "eval/accuracy" not in rows[1]
    for r in rows[1:]:
        assert set(r) >= DESIGN_KEYS, DESIGN_KEYS - set(r)
        assert "kl" not in r  # beta = 0
    assert [r["staleness/max"] for r in rows[1:]] == [0, 1, 0, 1]
    assert rows[-1]["groups_consumed"] == 8 and rows[-1]["groups_dead"] == b.dead
    assert rows[1]["reward"] == pytest.approx(0.5) and rows[1]["frac_reward_zero_std"] == 0.0
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["run"]["steps"] == 4 and cfg["learner"]["max_staleness"] == 1
    # Its log: a line per step (learner.log_every 1), with the newest held-out accuracy and the ETA.
    lines = re.findall(r"learner: (step +\d+/4 .*)$", (tmp_path / "learner.log").read_text(), re.M)
    assert [int(re.match(r"step +(\d+)", line).group(1)) for line in lines] == [1, 2, 3, 4]  # type: ignore[union-attr]
    assert lines[-1].endswith("eta 0:00") and f"accuracy {rows[2]['eval/accuracy']:.2f}" in lines[2]
    # Versions 0..4 were published; the newest three are kept.
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["v000002", "v000003", "v000004"]
    assert t.latest_weights().version == 4


def test_kl_penalty_loads_a_reference_and_reports_kl(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    t = Transport(RedisConfig(url=redis_url), "kl")
    t.produce([group(tok, v) for v in (0, 0, 1, 1, 2, 2)])
    run_dir = tmp_path / "run"
    run_learner(processes, redis_url, tiny_model_dir, tmp_path, "kl", 3, "learner.beta=0.04", "learner.lr=0.01")
    assert "KL penalty beta=0.04" in (tmp_path / "learner.log").read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    kls = [r["kl"] for r in rows]
    assert all(k >= 0 for k in kls) and kls[-1] > kls[0] and kls[-1] > 0  # the policy moves away from the reference


def test_a_zero_std_fraction_that_stays_high_raises_the_alarm(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    Transport(RedisConfig(url=redis_url), "al").produce([group(tok, v, all_right=True) for v in (0, 0, 1, 1, 2, 2)])
    run_learner(processes, redis_url, tiny_model_dir, tmp_path, "al", 3, "learner.alarm_window=2",
                "learner.alarm_zero_std=0.5")  # fmt: skip
    log = (tmp_path / "learner.log").read_text()
    assert log.count("alarm: frac_reward_zero_std above 0.5 for 2 steps") == 1, log


def malformed(i: int, rng: np.random.Generator, good: bytes) -> bytes:
    """Message number ``i`` of a flood of bad ones: every rejection of the schema table, random bytes, random
    msgpack, valid messages cut short, and well-formed groups whose token ids the model does not have."""
    from tests.unit.test_schemas import REJECTIONS, mutated

    kind = i % (len(REJECTIONS) + 4)
    if kind < len(REJECTIONS):
        path, value, _ = REJECTIONS[kind]
        return mutated(path, value)
    kind -= len(REJECTIONS)
    if kind == 0:
        return rng.bytes(int(rng.integers(0, 512)))
    if kind == 1:
        return msgpack.packb({"v": 1, "type": "group", str(i): rng.standard_normal(3).tolist()})
    if kind == 2:
        return good[: int(rng.integers(1, len(good)))]
    g = decode_group(good)
    ids = np.array([1, 40_000 + i], np.int32)
    return encode_group(GroupMessage(g.prompt_id, g.policy_version, "flood", ids, g.completions))


def test_a_flood_of_malformed_messages_into_a_live_learner(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    """1,200 malformed messages arrive while a learner trains: it keeps training, and every one of them is in the
    dead-letter stream with its reason and its exact bytes, and counted."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    t = Transport(RedisConfig(url=redis_url), "flood")
    settings = [
        f"redis.url={redis_url}", f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'run'}", "run.name=flood",
        "run.steps=6", "learner.batch_groups=2", "sampling.group_size=4", "task.eval_size=2",
        "learner.max_staleness=100",
    ]  # fmt: skip
    proc = processes.grpo("learner", *[a for o in settings for a in ("-o", o)], log=tmp_path / "learner.log")
    assert wait_until(lambda: t.latest_weights() is not None, 120), (tmp_path / "learner.log").read_text()

    rng = np.random.default_rng(0)
    good = group(tok, 0)
    bad = [malformed(i, rng, good) for i in range(1200)]
    for k in range(12):  # in rounds, each with one valid group, while the learner runs
        t.produce([*bad[k * 100 : (k + 1) * 100], group(tok, 0)])
    assert proc.wait(timeout=180) == 0, (tmp_path / "learner.log").read_text()

    b = read_balance(t)
    assert b.dead == 1200 and b.trained == 12 and b.unexplained == 0, b.equation()
    dead = t.client.xrange(t.keys.dead)
    assert Counter(f[b"payload"] for _, f in dead) == Counter(bad)
    assert all(f[b"reason"] for _, f in dead)
    assert "Traceback" not in (tmp_path / "learner.log").read_text()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 6 and rows[-1]["groups_dead"] == 1200


def test_sigterm_checkpoints_and_a_new_learner_resumes(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM while waiting for groups: a checkpoint, exit 0. The next `grpo learner` resumes from it by itself:
    step, version and counters continue; every step appears once in metrics.jsonl."""
    import signal

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    t = Transport(RedisConfig(url=redis_url), "resume")
    settings = [
        f"redis.url={redis_url}", f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'run'}", "run.name=resume",
        "run.steps=5", "learner.batch_groups=2", "sampling.group_size=4", "task.eval_size=2",
        "learner.max_staleness=100",
        "checkpoint.every=3",
    ]  # fmt: skip
    args = [a for o in settings for a in ("-o", o)]
    t.produce([group(tok, 0) for _ in range(4)])
    first = processes.grpo("learner", *args, log=tmp_path / "first.log")
    assert wait_until(lambda: (t.latest_weights() or WeightsStub).version == 2, 120), (
        tmp_path / "first.log"
    ).read_text()
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 0
    assert "checkpoint written" in (tmp_path / "first.log").read_text()
    assert t.lease_holder() is None  # SIGTERM gave the run up: the next learner does not wait the lease out
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-000002"]  # every=3: this one is SIGTERM's
    assert read_balance(t).trained == 4

    t.produce([group(tok, 2) for _ in range(6)])
    second = processes.grpo("learner", *args, log=tmp_path / "second.log")
    assert second.wait(timeout=180) == 0, (tmp_path / "second.log").read_text()
    assert "resumed from" in (tmp_path / "second.log").read_text()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert rows[-1]["groups_consumed"] == 10 and t.latest_weights().version == 5
    b = read_balance(t)
    assert b.trained == 10 and b.unexplained == 0
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-000003", "step-000005"]  # checkpoint.keep = 2

    # Started again after its last step (`docker compose up` once more): it says so, and how to start a new run.
    third = processes.grpo("learner", *args, log=tmp_path / "third.log")
    assert third.wait(timeout=180) == 0, (tmp_path / "third.log").read_text()
    assert (
        "run resume has trained its 5 steps already (its checkpoint is at step 5): nothing to do. For a new run "
        "give it another run.name (GRPO_RUN_NAME)" in (tmp_path / "third.log").read_text()
    )


class WeightsStub:
    version = -1
