"""A version loaded mid-answer under bfloat16 autocast over float32 weights, on the actor's own local engine: the
answers must be exactly what an engine whose every cast is fresh gives (autocast caches its bfloat16 copy of each
weight for a whole region, and the engine's ``generate`` is one region: a load in the middle must drop them).

    .venv/bin/python benchmarks/in_flight_autocast.py [--preset tiny|0.5b] [--device cpu|cuda] [--tokens 256]

A Llama built from a config (``--preset``; no download, random weights, float32) is saved and served by
``actor.engine.LocalEngine`` with ``actor.autocast=bfloat16`` and ``actor.weight_updates=in_flight``; a second
version (every weight nudged) is published and loaded through ``LocalEngine.load`` after ``--load-at`` decode steps,
for ``actor.in_flight_kv`` keep and recompute. Each is sampled three times from the same seed: as the engine runs,
with autocast's cache off (every cast fresh: the reference), and, for keep, with the engine's dropping of the cache
undone (what the engine did before it dropped them: the stale casts; recompute loads between two regions, whose end
drops them anyway). One JSON line each: the largest log-prob
difference from the reference over the tokens both share, whether the tokens are the same, and the stale casts'
difference, which must be far larger (else the check could not tell). Exit 1 when the engine's answers are not the
reference's. The prepared GPU check runs it with the 0.5B preset on CUDA (scripts/gpu_in_flight.sh).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.learner_throughput import PRESETS  # noqa: E402

SAME = 1e-4  # a kernel may sum in another order between two runs on a GPU; the stale casts' difference is ~0.1+


class LoadAt:
    """The updates the actor gives the engine: version 1 due after ``at`` decode steps, loaded by the engine."""

    def __init__(self, engine: Any, ann: Any, at: int):
        self.engine, self.ann, self.at, self.steps = engine, ann, at, 0

    def due(self) -> bool:
        self.steps += 1
        return self.engine.version == 0 and self.steps >= self.at

    def load(self) -> None:
        self.engine.load(self.ann)


def sample(path: Path, weights: Path, ann: Any, args: argparse.Namespace, kv: str, how: str) -> list[Any]:
    from actor.engines.local import LocalEngine
    from common.config import load_config

    cfg = load_config(None, [f"model.path={path}", f"model.device={args.device}", f"weights.dir={weights}",
                             "actor.autocast=bfloat16", "actor.weight_updates=in_flight", f"actor.in_flight_kv={kv}",
                             f"sampling.max_new_tokens={args.tokens}", "sampling.temperature=1.0"], env={})  # fmt: skip
    with ExitStack() as patches:
        if how == "fresh":  # every forward casts the weights it holds then
            patches.enter_context(
                mock.patch.object(torch, "autocast", functools.partial(torch.autocast, cache_enabled=False))
            )
        if how == "stale":  # the copies cast before the load stay in use
            patches.enter_context(mock.patch.object(torch, "clear_autocast_cache", lambda: None))
        engine = LocalEngine(cfg, seed=0)
        engine.stop_ids = set()  # answers of exactly --tokens tokens
        engine.updates = LoadAt(engine, ann, args.load_at)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, PRESETS[args.preset]["vocab_size"], (args.prompt_len,), generator=g).tolist()
                   for _ in range(args.prompts)]  # fmt: skip
        groups = engine.generate(prompts, args.samples)
        assert engine.version == 1, "the version was not loaded"
        return [s for group in groups for s in group]


def difference(ours: list[Any], theirs: list[Any]) -> tuple[float, bool]:
    """The largest log-prob difference over the tokens both answers share up to where they part, and whether every
    answer's tokens are the same."""
    worst, same = 0.0, True
    for a, b in zip(ours, theirs, strict=True):
        parted = (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)) if x != y)
        shared = next(parted, len(a.token_ids))
        same &= a.token_ids == b.token_ids
        worst = max([worst, *(abs(x - y) for x, y in zip(a.logprobs[:shared], b.logprobs[:shared], strict=True))])
    return worst, same


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128, help="new tokens per answer (no stop token)")
    p.add_argument("--load-at", type=int, default=32, help="the decode step after which the version is loaded")
    args = p.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from common.hardware import machine
    from common.weights import publish
    from ops.tiny_model import build_tokenizer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**PRESETS[args.preset], eos_token_id=None, bos_token_id=None)).eval()
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        path, weights = Path(tmp) / "model", Path(tmp) / "weights"
        model.save_pretrained(path)
        build_tokenizer().save_pretrained(path)
        with torch.no_grad():
            for v in model.parameters():
                v.add_(0.05 * v.abs().mean() * torch.randn_like(v))
        ann = publish(model, None, weights, 1, keep=2).announcement
        for kv in ("keep", "recompute"):
            hows = ("engine", "fresh", "stale") if kv == "keep" else ("engine", "fresh")
            runs = {how: sample(path, weights, ann, args, kv, how) for how in hows}
            worst, same = difference(runs["engine"], runs["fresh"])
            stale = difference(runs["stale"], runs["fresh"])[0] if "stale" in runs else None
            passed = same and worst <= SAME and (stale is None or stale > 100 * SAME)
            ok &= passed
            print(json.dumps({"check": "in-flight load under bf16 autocast", "preset": args.preset,
                              "device": args.device, "in_flight_kv": kv, "tokens": args.tokens,
                              "load_at": args.load_at, "max_abs_logprob_diff_vs_fresh_casts": worst,
                              "tokens_same_as_fresh_casts": same, "stale_casts_max_abs_diff": stale, "ok": passed,
                              "machine": machine()}))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
