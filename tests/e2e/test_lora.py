"""A LoRA run (learner.lora) of real `grpo learner` and `grpo actor` processes on a real Redis: the learner is
killed with SIGKILL mid-run and a new one resumes from its adapter checkpoint; every version and checkpoint is the
adapter alone; then `grpo export` merges the last version into its base, and plain transformers loads the folder
and answers greedily as the learner's policy does."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.children import wait_until
from common.config import RedisConfig
from common.transport import Transport
from ops.redis_server import RedisServer
from tests.faults.runs import run_settings

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

STEPS = 6


def test_a_lora_run_resumes_after_kill_9_and_exports(demo_model_dir: Path, tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    server = RedisServer(tmp_path / "redis").start()
    try:
        run_dir = _run(server.url, demo_model_dir, tmp_path, processes)
    finally:
        processes.stop_all()
        server.stop()
    _export_and_compare(run_dir, demo_model_dir, tmp_path)


def _run(url: str, model: Path, tmp: Path, processes) -> Path:  # type: ignore[no-untyped-def]
    run_dir = tmp / "run"
    args = run_settings(url, model, run_dir, "lora", STEPS, 4, "checkpoint.every=2", "learner.lr=2e-3",
                        "learner.lora.rank=8", "learner.lora.alpha=16")  # fmt: skip
    t = Transport(RedisConfig(url=url), "lora")
    logs = tmp / "logs"
    logs.mkdir()
    learner = processes.grpo("learner", *args, log=logs / "learner-1.log")
    actor = processes.grpo("actor", *args, "-o", "actor.id=actor-1", log=logs / "actor-1.log")

    def version() -> int:
        ann = t.latest_weights()
        return -1 if ann is None else ann.version

    assert wait_until(lambda: version() >= 3 or learner.poll() is not None, 300), _tail(logs)
    learner.kill()
    assert learner.wait() == -signal.SIGKILL, _tail(logs)
    learner = processes.grpo("learner", *args, log=logs / "learner-2.log")
    assert learner.wait(timeout=300) == 0, _tail(logs)
    assert actor.wait(timeout=60) == 0, _tail(logs)

    text = (logs / "learner-2.log").read_text()
    m = re.search(r"resumed from \S+: step (\d+), policy version (\d+)", text)
    assert m and int(m.group(1)) >= 2, text
    assert "LoRA rank 8" in (logs / "learner-1.log").read_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS + 1))
    assert rows[-1]["policy_version"] > STEPS  # the resumed learner continued past what the killed one published
    # The actor sampled with the adapters it was sent: the groups trained were at most max_staleness behind.
    assert all(r.get("staleness/max", 0) <= 4 for r in rows[1:])
    versions = sorted((run_dir / "weights").glob("v*"))
    assert versions and all((v / "adapter_model.safetensors").is_file() for v in versions)
    assert not [f for v in versions for f in v.glob("model*.safetensors")]
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    assert checkpoints and all((c / "adapter_model.safetensors").is_file() for c in checkpoints)
    return run_dir


def _export_and_compare(run_dir: Path, model: Path, tmp: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.model.generation import generate, pad_token_id, stop_token_ids
    from common.model.lora import wrap_as
    from common.weights import newest_on_disk, version_dir
    from common.weights.adapters import load_adapter, read_config

    out = tmp / "exported"
    done = subprocess.run([sys.executable, "-m", "common.cli", "export", str(run_dir), str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "LoRA merged" in done.stdout
    assert not list(out.glob("adapter*")) and (out / "config.json").is_file()

    # What the learner's policy is at the last version: the base with that adapter (as the learner holds it).
    last = version_dir(run_dir / "weights", newest_on_disk(run_dir / "weights"))
    learner = wrap_as(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), read_config(last)).eval()
    load_adapter(learner, load_file(str(last / "adapter_model.safetensors")))
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == AutoTokenizer.from_pretrained(model).chat_template
    prompts = [tok(f"{a}+{b}=").input_ids for a, b in [(1, 2), (3, 4), (5, 5), (7, 2), (9, 9), (0, 6)]]
    stops = stop_token_ids(plain, tok)

    def greedy(m) -> list[list[int]]:  # type: ignore[no-untyped-def]
        samples = generate(m, prompts, n=1, max_new_tokens=8, stop_ids=stops, pad_id=pad_token_id(tok, stops),
                           temperature=None)  # fmt: skip
        return [g[0].token_ids for g in samples]

    assert greedy(plain) == greedy(learner)
    # and the export moved away from the base: it is the trained policy, not the model it started from
    base = AutoModelForCausalLM.from_pretrained(model).eval()
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        assert (plain(input_ids=ids).logits - base(input_ids=ids).logits).abs().max() > 1e-4
    # `grpo eval` takes the LoRA version as it is (the adapter over its base) and grades as the export does.
    reports = [_eval(m, tmp / f"eval-{i}.json") for i, m in enumerate([last, out])]
    assert [p["greedy"] for p in reports[0]["per_problem"]] == [p["greedy"] for p in reports[1]["per_problem"]]
    assert reports[0]["model"] == str(last)
    # A second export into the same folder is refused in one line, exit 2, and changes nothing.
    again = subprocess.run([sys.executable, "-m", "common.cli", "export", str(run_dir), str(out)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert again.returncode == 2 and "not empty" in again.stderr and len(again.stderr.strip().splitlines()) == 1


def _eval(model: Path, out: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "common.cli", "eval", "--model", str(model), "--n", "0", "--out",
                           str(out), "-o", "task.eval_size=10", "-o", "grader.isolation=inline"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text())


def _tail(logs: Path) -> str:
    return "\n".join(f"== {p.name}\n" + p.read_text()[-3000:] for p in sorted(logs.iterdir()))
