"""A version loaded mid-generation, on the engine alone: how long generation stops for the load, and that the answers
in flight finish with the new version's tokens, for both ``actor.in_flight_kv`` choices.

    .venv/bin/python benchmarks/in_flight_engine.py [--preset tiny|0.5b] [--device cpu|cuda] [--tokens 1024]

A Llama built from a config (``--preset``; no download, random weights) samples ``--prompts`` × ``--samples``
answers of exactly ``--tokens`` tokens (no stop token) with the project's sampler (common.model.generation), once
without a load, then with a second version (the same model, every weight nudged) loaded after ``--load-at`` decode
steps: keep (copied in place between two steps, the cache kept) and recompute (the batch stopped, the version
loaded, prompt and answer so far prefilled again: actor.engines.recompute). One JSON line per run: seconds generating,
the load's pause (the time the decode loop stood still for it), tokens/s, and the versions the answers' tokens carry
(every answer must end with ``--tokens - --load-at`` tokens of the new version). The prepared GPU check runs it
with the 0.5B preset on CUDA (scripts/gpu_in_flight.sh).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.learner_throughput import PRESETS  # noqa: E402


def build(preset: str, device: str, dtype: torch.dtype) -> tuple[Any, dict[str, torch.Tensor]]:
    """The model, and a second version of its weights (each nudged by 1 % of its scale)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**PRESETS[preset])).to(device=device, dtype=dtype).eval()
    nudged = {k: v + 0.01 * v.abs().mean() * torch.randn_like(v) for k, v in model.state_dict().items()}
    return model, nudged


class LoadAt:
    """The updates an actor would give the engine: a version due after ``at`` decode steps, timed when loaded."""

    def __init__(self, model: Any, state: dict[str, torch.Tensor], at: int, version: list[int]):
        self.model, self.state, self.at, self.version = model, state, at, version
        self.steps, self.pause_s = 0, 0.0

    def due(self) -> bool:
        self.steps += 1
        return self.version[0] == 0 and self.steps >= self.at

    def load(self) -> None:
        from common.weights import load_into

        t0 = time.perf_counter()
        load_into(self.model, self.state)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.version[0] = 1
        self.pause_s = time.perf_counter() - t0


def sample(model: Any, prompts: list[list[int]], args: argparse.Namespace, kv: str | None) -> dict[str, Any]:
    from actor.engines.recompute import generate_recomputing
    from common.model.generation import generate

    version = [0]
    original = {k: v.clone() for k, v in model.state_dict().items()}
    updates = LoadAt(model, args.nudged, args.load_at, version)

    def run(p: Any, n: int, most: int, interrupt: Any = None, between: Any = None) -> Any:
        return generate(model, p, n=n, max_new_tokens=most, stop_ids=set(), pad_id=0, temperature=1.0,
                        version=lambda: version[0], each_step=between, interrupt=interrupt)  # fmt: skip

    if args.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if kv is None:
        groups = run(prompts, args.samples, args.tokens)
    elif kv == "keep":
        groups = run(prompts, args.samples, args.tokens, between=lambda: updates.due() and updates.load())
    else:
        groups = generate_recomputing(run, prompts, args.samples, args.tokens, updates)
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    model.load_state_dict(original)
    samples = [s for g in groups for s in g]
    runs = sorted({s.versions for s in samples})
    new_tokens = args.tokens - args.load_at
    return {
        "in_flight_kv": kv or "no load",
        "seconds": seconds,
        "load_pause_s": updates.pause_s,
        "tokens_per_s": sum(len(s.token_ids) for s in samples) / seconds,
        "version_runs": [list(map(list, r)) for r in runs],
        "answers_finish_with_new_version": kv is None or all(s.versions[-1] == (1, new_tokens) for s in samples),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256, help="new tokens per answer (no stop token)")
    p.add_argument("--load-at", type=int, default=64, help="the decode step after which the version is loaded")
    args = p.parse_args()
    from common.hardware import machine

    model, args.nudged = build(args.preset, args.device, getattr(torch, args.dtype))
    vocab = PRESETS[args.preset]["vocab_size"]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    sample(model, prompts[:1], argparse.Namespace(**{**vars(args), "tokens": 4}), None)  # warm-up
    ok = True
    for kv in (None, "keep", "recompute"):
        result = sample(model, prompts, args, kv)
        ok &= result["answers_finish_with_new_version"]
        print(json.dumps({"preset": args.preset, "device": args.device, "dtype": args.dtype, "tokens": args.tokens,
                          "load_at": args.load_at, **result, "machine": machine()}))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
