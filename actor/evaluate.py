"""``grpo eval``: how well a model answers a task's held-out problems, with the actors' engines and graders.

    grpo eval --model runs/demo/weights/v000200 --n 8 [--out report.json] [--config FILE] [-o key=value ...]

For each held-out problem (the ones ``grpo run`` never uses as RL prompts) it takes one greedy answer and ``n``
sampled at ``sampling.temperature``, grades them like the actors do, and reports

- ``accuracy_greedy``: the fraction of greedy answers that are right (the learner's ``eval/accuracy``);
- ``mean_at_n``: the mean reward over all sampled answers (an estimate of pass@1 when sampling);
- ``pass_at_n``: the fraction of problems with at least one right answer among the ``n``.

The engine is ``actor.engine`` (``local`` by default; ``sglang`` serves the model from a SGLang server), the grader
``grader.*``. The report (JSON) also lists each problem's scores.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.cli import role_parser
from common.config import load_config
from common.log import setup_logging

log = logging.getLogger("eval")


def summarise(greedy: list[float], sampled: list[list[float]]) -> dict[str, float]:
    """Pure: the report's figures from each problem's greedy score and its sampled scores."""
    n_problems = len(greedy)
    return {
        "accuracy_greedy": sum(1.0 for s in greedy if s >= 1.0) / n_problems,
        "mean_at_n": sum(sum(s) / len(s) for s in sampled) / n_problems,
        "pass_at_n": sum(1.0 for s in sampled if max(s) >= 1.0) / n_problems,
    }


def main(argv: Sequence[str]) -> int:
    p = role_parser("grpo eval", (__doc__ or "").splitlines()[0])
    p.add_argument("--model", required=True, help="an HF model directory (e.g. a published version) or hub name")
    p.add_argument("--n", type=int, default=8, help="sampled answers per problem (mean@n, pass@n)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here too")
    args = p.parse_args(list(argv))
    if args.n < 1:
        p.error("--n must be at least 1")
    cfg = load_config(args.config, [*args.override, f"model.path={args.model}"])
    setup_logging("eval", cfg.run.log_level)
    report = evaluate(cfg, args.n)
    text = json.dumps(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    print(
        f"{report['task']}: {report['problems']} held-out problems; greedy accuracy {report['accuracy_greedy']:.3f}, "
        f"mean@{args.n} {report['mean_at_n']:.3f}, pass@{args.n} {report['pass_at_n']:.3f} ({report['seconds']:.1f}s)",
        file=sys.stderr,
    )
    return 0


def evaluate(cfg: Any, n: int) -> dict[str, Any]:
    import torch

    from actor.engine import make_engine
    from common.config import check_model_path
    from common.tasks import make_task
    from grader.pool import open_grader

    torch.set_num_threads(cfg.actor.torch_threads)
    check_model_path(cfg.model.path)
    task = make_task(cfg.task.name, cfg.task.eval_size, cfg.run.seed)
    problems = task.eval
    t0 = time.perf_counter()
    engine = make_engine(cfg, seed=cfg.run.seed)
    grader = open_grader(cfg.grader)
    try:
        prompts = [list(engine.tokenizer(p.prompt).input_ids) for p in problems]
        references = [p.reference for p in problems]
        greedy = engine.generate(prompts, 1, greedy=True)
        sampled = engine.generate(prompts, n)
        require_stop = cfg.task.require_stop
        g = grader.grade_samples(engine.tokenizer, [s[0] for s in greedy], references, require_stop=require_stop)
        flat = [s for group in sampled for s in group]
        r = grader.grade_samples(engine.tokenizer, flat, [ref for ref in references for _ in range(n)],
                                 require_stop=require_stop)  # fmt: skip
    finally:
        grader.close()
        engine.close()
    scores = [r.scores[i * n : (i + 1) * n] for i in range(len(problems))]
    return {
        "model": cfg.model.path,
        "task": cfg.task.name,
        "problems": len(problems),
        "n": n,
        "temperature": cfg.sampling.temperature,
        "engine": cfg.actor.engine,
        "grader": cfg.grader.name,
        **summarise(g.scores, scores),
        "grader_errors": dict(g.errors + r.errors),
        "seconds": round(time.perf_counter() - t0, 2),
        "per_problem": [
            {"id": p.id, "greedy": gs, "sampled": ss} for p, gs, ss in zip(problems, g.scores, scores, strict=True)
        ],
    }
