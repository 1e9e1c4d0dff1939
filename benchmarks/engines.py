"""B6 engines: one actor's generation with the ``sglang`` engine (a real SGLang server it launches) against the
``local`` engine (transformers in the actor's process), same model, prompts and sampling settings, in one run.

    .venv/bin/python benchmarks/engines.py [--quick] [--model DIR ...] [--out result.json]

Each engine samples the same rounds an actor samples (``actor.prompts_per_round`` prompts of the demo task ×
``sampling.group_size``, at ``sampling.temperature``, up to ``sampling.max_new_tokens``), after one warm-up round, and
the figure is completions/s and tokens/s of SGLang ÷ local's. Both engines get all of this machine's cores (the local
engine's torch threads; the server's OpenMP threads). Models: the demo model (up to 4 new tokens, as the demo samples
them; it ends its answers after about 3) and any ``--model`` given (an HF directory, e.g. a pretrained instruct
model, whose chat template the prompts then use), sampled as a real model's recipe would (4 prompts x 8 per round,
up to 32 new tokens at temperature 0.7). Needs SGLang's venv (``scripts/sglang_env.sh``). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from common.config import Config, load_config  # noqa: E402
from common.tasks import PromptEncoder, make_task  # noqa: E402


def rounds_of_prompts(cfg: Config, tokenizer: object, rounds: int) -> list[list[list[int]]]:
    task, encode = make_task(cfg.task, cfg.run.seed), PromptEncoder(tokenizer, cfg.task)
    n = cfg.actor.prompts_per_round
    return [[encode(task.at(r * n + i).prompt) for i in range(n)] for r in range(rounds + 1)]


def measure(engine: object, batches: list[list[list[int]]], group: int) -> dict:
    engine.generate(batches[0], group)  # type: ignore[attr-defined]  # warm-up: first calls compile and allocate
    completions = tokens = 0
    t0 = time.perf_counter()
    for prompts in batches[1:]:
        for g in engine.generate(prompts, group):  # type: ignore[attr-defined]
            completions += len(g)
            tokens += sum(len(s.token_ids) for s in g)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "completions_per_s": completions / seconds, "tokens_per_s": tokens / seconds,
            "mean_tokens": tokens / completions}  # fmt: skip


def case(name: str, overrides: list[str], rounds: int) -> dict:
    from actor.engine import LocalEngine
    from actor.sglang_engine import SGLangEngine

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config(None, [f"run.dir={run_dir}", "actor.engine=sglang", *overrides])
        torch.set_num_threads(os.cpu_count() or 1)
        local = LocalEngine(cfg, seed=0)
        batches = rounds_of_prompts(cfg, local.tokenizer, rounds)
        result: dict = {"case": name, "prompts_per_round": cfg.actor.prompts_per_round,
                        "group_size": cfg.sampling.group_size, "max_new_tokens": cfg.sampling.max_new_tokens,
                        "rounds": rounds, "local": measure(local, batches, cfg.sampling.group_size)}  # fmt: skip
        del local
        server = SGLangEngine(cfg, seed=0, name="b6")
        try:
            result["sglang"] = measure(server, batches, cfg.sampling.group_size)
        finally:
            server.close()
    for key in ("completions_per_s", "tokens_per_s"):
        result[f"{key}_ratio"] = result["sglang"][key] / result["local"][key]
    return result


def run(quick: bool, models: list[str] | None = None) -> dict:
    from ops.tiny_model import ensure_tiny_model

    demo = str(ensure_tiny_model(seed=0, eval_size=20))
    rounds = 4 if quick else 12
    cases = [("demo model", [f"model.path={demo}"], rounds)]
    for m in models or []:  # a pretrained model: fewer, longer completions, as its recipe samples them
        overrides = [f"model.path={m}", "sampling.max_new_tokens=32", "sampling.temperature=0.7",
                     "actor.prompts_per_round=4"]  # fmt: skip
        cases.append((f"{Path(m).name}", overrides, max(2, rounds // 2)))
    return {"cases": [case(name, overrides, n) for name, overrides, n in cases]}


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--model", action="append", default=[], help="another HF model directory to measure")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    result = run(args.quick, args.model)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
