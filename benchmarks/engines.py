"""B6 engines: one actor's generation with a real SGLang server against the local engine, on the same workload.

    .venv/bin/python benchmarks/engines.py [--config FILE ...] [--in-flight 1 2 4 8] [--trials 5] [--quick]
                                           [-o KEY=VALUE ...] [--out F]

The workload is a recipe's (each ``--config``; ``demo`` or none = the demo's): its model, task, prompts per round x
group size, temperature, token limit and threads (``actor.torch_threads``). Both engines compute on that many cores
that the client does not use: the local engine runs in this process, pinned to the first cores; SGLang's server
processes are pinned to the next ones (with that many torch threads, as an actor launches it) while this process,
its client, keeps the first. SGLang runs as it would in earnest: the preloads of its CPU recipe
(``sglang.cpu_preload``), ``--skip-tokenizer-init`` (the client sends token ids and reads token ids),
``OMP_WAIT_POLICY=ACTIVE`` on cores of its own, and the attention backend of ``sglang.cpu_args`` (``-o`` sets any
key for every case: another interpreter, another backend). Its start-up is outside the timed region and reported
apart.

A trial submits k rounds at once (k = each ``--in-flight`` value; the server batches them continuously, as it would
an actor's requests in flight) and times them until the last completes; the local engine generates one round at a
time, so it is measured at k = 1. Each figure is the median of ``--trials`` trials, with its min and max; ratios are
SGLang's completions/s at each k over local's. The result names the machine (CPU, features, cores, load).
Needs SGLang's venv (``scripts/sglang_env.sh``). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from common.config import Config, load_config  # noqa: E402
from common.hardware import machine  # noqa: E402
from common.tasks import PromptEncoder, make_task  # noqa: E402

Rounds = list[list[list[int]]]


def rounds_of_prompts(cfg: Config, tokenizer: object, rounds: int) -> Rounds:
    task, encode = make_task(cfg.task, cfg.run.seed), PromptEncoder(tokenizer, cfg.task)
    n = cfg.actor.prompts_per_round
    return [[encode(task.at(r * n + i).prompt) for i in range(n)] for r in range(rounds)]


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def trial(engine: Any, rounds: Rounds, group: int, in_flight: int) -> dict:
    """``in_flight`` rounds submitted at once; completions and tokens per second until the last one is back."""
    t0 = time.perf_counter()
    if in_flight == 1:
        replies = [engine.generate(rounds[0], group)]
    else:
        with ThreadPoolExecutor(in_flight) as pool:
            replies = list(pool.map(lambda prompts: engine.generate(prompts, group), rounds[:in_flight]))
    seconds = time.perf_counter() - t0
    completions = sum(len(g) for groups in replies for g in groups)
    tokens = sum(len(s.token_ids) for groups in replies for g in groups for s in g)
    return {"seconds": seconds, "completions": completions, "tokens": tokens}


def measure(engine: Any, rounds: Rounds, group: int, in_flight: int, trials: int) -> dict:
    engine.generate(rounds[0], group)  # warm-up: the first calls compile and allocate
    runs = [trial(engine, rounds[t % 2 :], group, in_flight) for t in range(trials)]
    return {
        "in_flight": in_flight,
        "trials": runs,
        "completions_per_s": spread([r["completions"] / r["seconds"] for r in runs]),
        "tokens_per_s": spread([r["tokens"] / r["seconds"] for r in runs]),
        "mean_tokens": sum(r["tokens"] for r in runs) / sum(r["completions"] for r in runs),
    }


def cores(threads: int) -> tuple[set[int], set[int]]:
    """The client's cores and the server's: apart where there are enough, else shared (said in the result)."""
    mine = sorted(os.sched_getaffinity(0))
    return set(mine[:threads]), set(mine[threads : 2 * threads] or mine[:threads])


def case(config: str | None, trials: int, in_flight: list[int], extra: list[str]) -> dict:
    from actor.engines.local import LocalEngine
    from actor.engines.sglang.engine import SGLangEngine
    from common.model.importing import prepare_model_path
    from ops.tiny_model import ensure_tiny_model

    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [f"run.dir={run_dir}", "actor.engine=sglang", *extra]
        if config is None:
            overrides.append(f"model.path={ensure_tiny_model(seed=0, eval_size=20)}")
        cfg = load_config(config, overrides)
        prepare_model_path(cfg)
        threads = cfg.actor.torch_threads
        client, server_cores = cores(threads)
        all_cores = os.sched_getaffinity(0)
        group = cfg.sampling.group_size
        result: dict = {"case": Path(config).stem if config else "demo", "model": cfg.model.path,
                        "prompts_per_round": cfg.actor.prompts_per_round, "group_size": group,
                        "max_new_tokens": cfg.sampling.max_new_tokens, "temperature": cfg.sampling.temperature,
                        "threads": threads, "client_cores": sorted(client), "server_cores": sorted(server_cores),
                        "trials": trials}  # fmt: skip
        os.sched_setaffinity(0, client)
        torch.set_num_threads(threads)
        local = LocalEngine(cfg, seed=0)
        rounds = rounds_of_prompts(cfg, local.tokenizer, max(in_flight) + 1)
        result["local"] = measure(local, rounds, group, 1, trials)
        del local
        # The server's processes inherit this affinity: all of them on the server's cores, the client on its own.
        os.sched_setaffinity(0, server_cores)
        os.environ.update(OMP_WAIT_POLICY="ACTIVE")  # on cores of its own, its threads need not yield
        cfg.sglang.cpu_args = [*cfg.sglang.cpu_args, "--skip-tokenizer-init"]
        t0 = time.perf_counter()
        try:
            server = SGLangEngine(cfg, seed=0, name="b6")
        finally:
            os.sched_setaffinity(0, client)
        result["sglang_startup_s"] = time.perf_counter() - t0
        try:
            result["sglang"] = [measure(server, rounds, group, k, trials) for k in in_flight]
        finally:
            server.close()
            os.sched_setaffinity(0, all_cores)
    local_rate = result["local"]["completions_per_s"]["median"]
    result["completions_per_s_ratio"] = {
        str(m["in_flight"]): m["completions_per_s"]["median"] / local_rate for m in result["sglang"]
    }
    return result


def run(quick: bool, configs: list[str] | None = None, in_flight: list[int] | None = None,
        trials: int | None = None, overrides: list[str] | None = None) -> dict:  # fmt: skip
    in_flight = in_flight or ([1, 4] if quick else [1, 2, 4, 8])
    trials = trials or (2 if quick else 5)
    recipes: list[str | None] = [None if c == "demo" else c for c in configs] if configs else [None]
    extra = overrides or []
    return {"machine": machine(), "overrides": extra, "cases": [case(c, trials, in_flight, extra) for c in recipes]}


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--config", action="append", default=None, help="a recipe whose workload to measure (repeatable)")
    p.add_argument("--in-flight", type=int, nargs="+", default=None, help="rounds in flight (default 1 2 4 8)")
    p.add_argument("--trials", type=int, default=None, help="trials per figure (default 5)")
    p.add_argument("--quick", action="store_true", help="in flight 1 and 4, 2 trials")
    p.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every case, e.g. sglang.python=... or sglang.cpu_args=[...]",
    )
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    result = run(args.quick, args.config, args.in_flight, args.trials, args.override)
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
