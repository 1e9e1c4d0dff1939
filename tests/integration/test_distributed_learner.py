"""`grpo learner` under torchrun: two ranks, FSDP2 over gloo on the CPU, against a real Redis. On the same groups it
trains as one process does (the loss of every step and the published weights agree to float tolerance), and a
checkpoint written by the two ranks resumes in one process."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from common.children import wait_until
from common.config import RedisConfig
from common.schemas import Completion, GroupMessage, encode_group
from common.transport import Transport, read_balance
from common.weights import load_state_dict

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GROUP, BATCH, STEPS = 4, 4, 3


def sampled_groups(model_dir: Path, n: int) -> list[bytes]:
    """Groups the tiny model itself sampled (real behaviour log-probs, lengths that differ), rewards 1, 0, 1, 0."""
    from common.model.generation import generate, stop_token_ids
    from common.model.loading import load_pretrained

    tok, model = load_pretrained(str(model_dir), "float32", "cpu")
    torch.manual_seed(0)
    prompts = [tok(f"{i % 10}+{(3 * i) % 10}=").input_ids for i in range(n)]
    sampled = generate(model, prompts, n=GROUP, max_new_tokens=4, stop_ids=stop_token_ids(model, tok),
                       pad_id=tok.pad_token_id, temperature=1.0)  # fmt: skip
    out = []
    for i, (prompt, samples) in enumerate(zip(prompts, sampled, strict=True)):
        comps = tuple(
            Completion(
                np.array(s.token_ids, np.int32), np.array(s.logprobs, np.float32), float(j % 2 == 0), s.finish_reason
            )
            for j, s in enumerate(samples)
        )
        out.append(encode_group(GroupMessage(f"p{i}", 0, "test", np.array(prompt, np.int32), comps)))
    return out


def learner_command(world: int) -> list[str]:
    if world == 1:
        return [sys.executable, "-m", "common.cli", "learner"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
            "-m", "common.cli", "learner"]  # fmt: skip


def train(processes, world: int, url: str, model: Path, root: Path, run: str, steps: int, *extra: str) -> list[dict]:  # type: ignore[no-untyped-def]
    settings = [
        f"redis.url={url}", f"model.path={model}", f"run.name={run}", f"run.dir={root / run}", f"run.steps={steps}",
        f"sampling.group_size={GROUP}", f"learner.batch_groups={BATCH}", "learner.updates_per_batch=2",
        "learner.grad_accum=2", "learner.lr=1e-3", "learner.max_staleness=10", "learner.eval_every=1000",
        "task.eval_size=5", "checkpoint.every=1", "metrics.port=0", *extra,
    ]  # fmt: skip
    log = root / f"{run}-{world}-ranks.log"
    proc = processes.start([*learner_command(world), *[a for o in settings for a in ("-o", o)]], log)
    assert proc.wait(timeout=300) == 0, log.read_text()[-5000:]
    return [json.loads(line) for line in (root / run / "metrics.jsonl").read_text().splitlines()]


def published(url: str, run: str) -> dict[str, torch.Tensor]:
    t = Transport(RedisConfig(url=url), run)
    try:
        ann = t.latest_weights()
        assert ann is not None
        return load_state_dict(ann)[0]
    finally:
        t.close()


# The defaults (dapo, proximal old log-probs, no KL), the other paths through the loss: bnpo's per-micro-batch
# token mean, the engine's log-probs as the denominator, and a KL penalty against a reference model sharded too; and
# micro-batches by tokens, which every rank must form alike.
SETTINGS = [
    [],
    ["learner.loss_type=bnpo", "learner.old_logprobs=behavior", "learner.beta=0.05"],
    ["learner.grad_accum=1", "learner.micro_batch_tokens=48"],
]


@pytest.mark.parametrize("extra", SETTINGS, ids=["dapo", "bnpo-behavior-kl", "token-micro-batches"])
def test_two_ranks_train_as_one_process_and_resume_in_one(  # type: ignore[no-untyped-def]
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes, extra: list[str]
) -> None:
    payloads = sampled_groups(tiny_model_dir, BATCH * STEPS)
    for run in ("one", "two", "resumed"):
        t = Transport(RedisConfig(url=redis_url), run)
        t.ensure_consumer_group()
        t.produce(payloads)
        t.close()

    one = train(processes, 1, redis_url, tiny_model_dir, tmp_path, "one", STEPS, *extra)
    two = train(processes, 2, redis_url, tiny_model_dir, tmp_path, "two", STEPS, *extra)
    assert "FSDP2 over 2 ranks" in (tmp_path / "two-2-ranks.log").read_text()
    losses = [[r["loss"] for r in rows if r["step"] > 0] for rows in (one, two)]
    assert len(losses[0]) == STEPS and losses[0] == pytest.approx(losses[1], rel=1e-4, abs=1e-6)
    keys = ["clip_ratio/region_mean", "entropy", "reward", "completions/mean_length", "grad_norm"]
    for key in keys + (["kl"] if "learner.beta=0.05" in extra else []):
        assert [r[key] for r in one[1:]] == pytest.approx([r[key] for r in two[1:]], rel=1e-4, abs=1e-6), key
    w1, w2 = published(redis_url, "one"), published(redis_url, "two")
    assert w1.keys() == w2.keys()
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], rtol=1e-4, atol=1e-5, msg=name)
    start = load_file(str(tiny_model_dir / "model.safetensors"))  # training did move the weights
    assert any(not torch.allclose(w1[n], start[n], atol=1e-4) for n in start if n in w1)

    # Two ranks for two steps and their checkpoint, then one process for the third step.
    train(processes, 2, redis_url, tiny_model_dir, tmp_path, "resumed", STEPS - 1, *extra)
    assert (tmp_path / "resumed" / "checkpoints" / f"step-{STEPS - 1:06d}" / "optimizer.safetensors").is_file()
    rows = train(processes, 1, redis_url, tiny_model_dir, tmp_path, "resumed", STEPS, *extra)
    assert "resumed from" in (tmp_path / "resumed-1-ranks.log").read_text()
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert [r["loss"] for r in rows[1:]] == pytest.approx(losses[0], rel=1e-4, abs=1e-6)
    w3 = published(redis_url, "resumed")
    for name in w1:
        torch.testing.assert_close(w3[name], w1[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["learner.batch_groups=2"],
         "learner.batch_groups: micro-batches of 1 completions cannot be split over 2 ranks"),
        (["learner.batch_groups=8", "learner.lora.rank=4"],
         "learner.lora.rank: LoRA trains in one learner process, not under torchrun (2 ranks)"),
    ],
)  # fmt: skip
def test_what_cannot_run_over_ranks_is_refused_in_one_line(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes, extra: list[str], said: str
) -> None:  # type: ignore[no-untyped-def]
    log = tmp_path / "learner.log"
    settings = [
        f"redis.url={redis_url}", f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'run'}",
        "sampling.group_size=2", "learner.updates_per_batch=2", "learner.grad_accum=2", *extra,
    ]  # fmt: skip
    proc = processes.start([*learner_command(2), *[a for o in settings for a in ("-o", o)]], log)
    assert proc.wait(timeout=120) != 0
    assert said in log.read_text()


def test_sigterm_to_torchrun_checkpoints_the_last_step_and_loses_nothing(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    """What `docker compose stop` or a pod's deletion does: torchrun passes SIGTERM on, rank 0 finishes its step,
    every rank joins the final checkpoint, and the groups it covers are acknowledged (torchrun itself exits 1 on a
    signal, by its own design; the learner's state is what matters)."""
    settings = [
        f"redis.url={redis_url}", f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'run'}", "run.steps=100000",
        f"sampling.group_size={GROUP}", f"learner.batch_groups={BATCH}", "actor.prompts_per_round=4", "metrics.port=0",
        "task.eval_size=5", "checkpoint.every=1000",
    ]  # fmt: skip
    args = [a for o in settings for a in ("-o", o)]
    processes.grpo("actor", *args, "-o", "actor.id=a1", log=tmp_path / "actor.log")
    learner = processes.start([*learner_command(2), *args], tmp_path / "learner.log")
    rows = tmp_path / "run" / "metrics.jsonl"
    assert wait_until(lambda: rows.exists() and len(rows.read_text().splitlines()) >= 4, 180), (
        tmp_path / "learner.log"
    ).read_text()[-3000:]
    learner.send_signal(signal.SIGTERM)
    learner.wait(timeout=120)
    log = (tmp_path / "learner.log").read_text()
    assert "(asked to stop); checkpoint written" in log, log[-3000:]
    steps = [json.loads(line)["step"] for line in rows.read_text().splitlines()]
    newest = max(int(p.name.split("-")[1]) for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert newest == steps[-1] >= 3  # checkpoint.every=1000: this one was written on the signal
    t = Transport(RedisConfig(url=redis_url), "default")
    try:
        b = read_balance(t)
        # Groups read for the batch the signal interrupted stay pending: the next learner takes them over.
        assert b.trained == steps[-1] * BATCH and b.pending < BATCH and b.unexplained == 0
    finally:
        t.close()


def test_rank_zero_sends_weights_over_an_update_group_beside_the_training_group(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path, processes
) -> None:  # type: ignore[no-untyped-def]
    """weights.transport=nccl under torchrun: rank 0 forms the update group with an actor (the local engine joins it
    itself) while every rank trains in the FSDP group; versions between the first and the last go over it."""
    steps = 6
    settings = [
        f"redis.url={redis_url}", f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'run'}", f"run.steps={steps}",
        f"sampling.group_size={GROUP}", f"learner.batch_groups={BATCH}", "actor.prompts_per_round=4", "metrics.port=0",
        "task.eval_size=5", "learner.max_staleness=10", "actor.filter_zero_std=false", "weights.transport=nccl",
        "weights.nccl_backend=gloo", "weights.nccl_address=127.0.0.1", "weights.disk_every=0", "run.log_level=DEBUG",
        "weights.nccl_timeout_s=30",
    ]  # fmt: skip
    args = [a for o in settings for a in ("-o", o)]
    actor = processes.grpo("actor", *args, "-o", "actor.id=a1", log=tmp_path / "actor.log")
    learner = processes.start([*learner_command(2), *args], tmp_path / "learner.log")
    assert learner.wait(timeout=300) == 0, (tmp_path / "learner.log").read_text()[-5000:]
    assert actor.wait(timeout=60) == 0, (tmp_path / "actor.log").read_text()[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["weights/nccl_rounds"] >= 1 and rows[-1]["weights/nccl_fallbacks"] == 0, rows[-1]
    received = [line for line in (tmp_path / "actor.log").read_text().splitlines() if "over NCCL in" in line]
    assert received, (tmp_path / "actor.log").read_text()[-3000:]
    assert sorted({p.name for p in (tmp_path / "run" / "weights").glob("v*")}) == ["v000000", f"v{steps:06d}"]
