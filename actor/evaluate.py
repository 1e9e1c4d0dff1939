"""``grpo eval``: how well a model answers held-out problems, with the actors' engines and graders.

    grpo eval --model runs/demo/weights/v000200 [--n 8] [--out report.json] [--config FILE] [-o key=value ...]
    grpo eval --model Qwen/Qwen2.5-0.5B-Instruct --dataset openai/gsm8k --subset main --split test --n 8 \\
        --config configs/gsm8k-qwen2.5-0.5b.yaml

Without ``--dataset`` it grades the task's held-out problems (the ones ``grpo run`` never uses as RL prompts, the
same the learner's ``eval/accuracy`` grades). ``--dataset`` (a file, a dataset directory or a hub name) grades the
rows of ``--split`` of it instead, all of them unless ``--limit``, with the config's field mapping, prompt template
and chat template (``task.*``). Figures (see common/tasks/evaluation.py): ``pass_at_1`` (greedy), ``mean_at_n`` and
``pass_at_n`` over ``n`` answers sampled at ``sampling.temperature``.

The engine is ``actor.engine`` (``local`` by default; ``sglang`` serves the model from a SGLang server), the grader
``grader.*`` (with ``combine``, its components other than ``format``: an answer is right or wrong, see
common/tasks/evaluation.py). The report (JSON, on stdout and in ``--out``) also lists each problem's scores.
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
from common.config import check_device, check_engine, load_config
from common.log import setup_logging

log = logging.getLogger("eval")


def main(argv: Sequence[str]) -> int:
    p = role_parser("grpo eval", (__doc__ or "").splitlines()[0])
    p.add_argument("--model", required=True, help="an HF model directory (e.g. a published version, or a LoRA "
                   "version, applied over its base) or hub name")  # fmt: skip
    p.add_argument("--n", type=int, default=8, help="sampled answers per problem (mean@n, pass@n); 0 = greedy only")
    p.add_argument("--dataset", help="evaluate on this file, dataset directory or hub name (sets task.eval_path)")
    p.add_argument("--subset", help="the hub dataset's configuration (task.subset), e.g. main for openai/gsm8k")
    p.add_argument("--split", help="the split of --dataset to grade (task.eval_split; default test)")
    p.add_argument("--limit", type=int, help="grade only the first this many problems (task.eval_size)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here too")
    args = p.parse_args(list(argv))
    if args.n < 0:
        p.error("--n must be 0 or more")
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be at least 1")
    # Strings as JSON (valid YAML): a path holding ": " or "#" stays a string.
    overrides = [*args.override, f"model.path={json.dumps(args.model)}"]
    if args.dataset:
        overrides += [
            "task.name=dataset",
            f"task.eval_path={json.dumps(args.dataset)}",
            f"task.eval_size={args.limit or 0}",
        ]
    elif args.limit:
        overrides.append(f"task.eval_size={args.limit}")
    overrides += [f"task.subset={json.dumps(args.subset)}"] if args.subset is not None else []
    overrides += [f"task.eval_split={json.dumps(args.split)}"] if args.split is not None else []
    cfg = load_config(args.config, overrides)
    setup_logging("eval", cfg.run.log_level)
    adapter = lora_version(cfg)
    if cfg.actor.engine == "local":
        check_device(cfg.model.device)
    check_engine(cfg.actor.engine, cfg.sglang.url, cfg.sglang.device, cfg.learner.lora.rank)
    report = evaluate(cfg, args.n, adapter)
    text = json.dumps(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    sampled = f", mean@{args.n} {report['mean_at_n']:.3f}, pass@{args.n} {report['pass_at_n']:.3f}" if args.n else ""
    print(
        f"{report['task']}: {report['problems']} problems; pass@1 (greedy) {report['pass_at_1']:.3f}{sampled} "
        f"({report['seconds']:.1f}s)",
        file=sys.stderr,
    )
    return 0


def lora_version(cfg: Any) -> Any:
    """``--model`` a LoRA version (learner.lora): the engine serves its base (``base.json``) and the adapter is
    loaded into it as the actors load it, verified against its digest; returns its announcement (None for a model
    of whole weights). The config is set for that: model.path, weights.dir, learner.lora's rank and layers."""
    from common.config import ConfigError
    from common.schemas import WeightsAnnouncement
    from common.weights.adapters import ADAPTER_CONFIG, is_adapter_dir, read_base

    version = Path(cfg.model.path)
    if not is_adapter_dir(version):
        cfg.learner.lora.rank = 0  # a model of whole weights: no adapter to serve, whatever the config trains
        return None
    base = read_base(version).get("path", "")
    try:
        digest = (version / "digest").read_text().strip()
        adapter = json.loads((version / ADAPTER_CONFIG).read_text())
        rank, modules = int(adapter["r"]), sorted(adapter["target_modules"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"config error: model.path: {version} is not a published LoRA version ({e!r})") from None
    if not base or (base.startswith(("/", ".")) and not Path(base).is_dir()):  # a path that is not here
        raise ConfigError(f"config error: model.path: {version} is a LoRA adapter whose base {base!r} is not a "
                          "directory here; merge it into its base first (grpo export --base DIR) and evaluate "
                          "that")  # fmt: skip
    cfg.model.path, cfg.weights.dir = base, str(version.parent)
    cfg.learner.lora.rank, cfg.learner.lora.target_modules = rank, modules
    number = version.name.removeprefix("v")
    return WeightsAnnouncement(int(number) if number.isdigit() else 0, str(version), digest, "lora-safetensors")


def evaluate(cfg: Any, n: int, adapter: Any = None) -> dict[str, Any]:
    import torch

    from actor.engines import make_engine
    from common.model.importing import prepare_model_path
    from common.tasks import PromptEncoder, eval_problems
    from common.tasks.evaluation import correctness, score_problems, summarise
    from env.episodes import episode_generate, open_episodes
    from grader.open import open_grader

    torch.set_num_threads(cfg.actor.torch_threads)
    prepare_model_path(cfg)
    problems = eval_problems(cfg.task, cfg.run.seed)
    t0 = time.perf_counter()
    engine = make_engine(cfg, seed=cfg.run.seed)
    if adapter is not None:  # a LoRA version over its base, as the actors apply it
        engine.load(adapter)
    grader = open_grader(correctness(cfg.grader))  # right or wrong, not the training reward (common.tasks.evaluation)
    episodes = open_episodes(cfg, engine.tokenizer, engine.stop_ids)  # with the environment, as trained
    try:
        encode = PromptEncoder(engine.tokenizer, cfg.task)
        generate = episode_generate(episodes, lambda prompts, k, greedy, _: engine.generate(prompts, k, greedy=greedy))
        scores = score_problems(problems, encode, generate, grader, engine.tokenizer, n=n, batch=cfg.task.eval_batch,
                                require_stop=cfg.task.require_stop)  # fmt: skip
    finally:
        grader.close()
        engine.close()
        if episodes is not None:
            episodes.close()
    return {
        "model": adapter.uri if adapter is not None else cfg.model.path,
        "task": cfg.task.eval_path or cfg.task.path or cfg.task.name,
        "problems": len(problems),
        "n": n,
        "temperature": cfg.sampling.temperature,
        "engine": cfg.actor.engine,
        "grader": cfg.grader.name,
        "chat_template": encode.chat,
        **summarise(scores.greedy, scores.sampled),
        "grader_errors": dict(scores.errors),
        "seconds": round(time.perf_counter() - t0, 2),
        "per_problem": [
            {"id": p.id, "greedy": g, "sampled": s}
            for p, g, s in zip(problems, scores.greedy, scores.sampled, strict=True)
        ],
    }
