"""B2 against TRL: TRL's ``GRPOTrainer`` and the project's ``grpo run`` on the same demo model, task and settings,
measured in the same run: completions trained per second and wall-clock seconds to the demo's target reward.

    .venv/bin/python benchmarks/versus_trl.py [--quick] [--steps N] [--out result.json] [--png b2.png]

Needs TRL (the ``bench`` extra). Both sides start from the demo model (seed 0's) and train on the same 80 addition
problems, holding out the same 20, with the demo's settings: G = 8 completions per prompt, batches of 32 prompts
(256 completions) split into 4 mini-batches of 64 with one AdamW step each (lr 7e-5, betas 0.9/0.99, no weight
decay, gradient norm clipped at 1), the ``dapo`` loss with ε 0.2 / 0.28, β = 0, temperature 1, at most 4 new tokens,
rewards scaled by their group's std, graded by the same grader (the answer followed by end-of-sequence). In TRL's
terms: ``per_device_train_batch_size`` 64 and ``steps_per_generation`` 4 (a generation of 256 completions),
``num_iterations`` 1, so that a TRL generation is a learner step here.

What differs is what each system is: the project runs its demo as it ships (two actor processes sampling while the
learner trains, zero-std groups filtered and more prompts sampled, each process on one thread), TRL alternates
generation and training in one process (given both threads). Each side's clock starts when training starts (models
loaded) and includes its held-out evaluations (greedy pass@1 on the 20 problems every 10 steps, the same code on
both sides). The reward of a step is the mean over every completion sampled for it, as both systems report it.

Figures: ``completions_per_s_ratio`` = project ÷ TRL completions trained per second (goal ≥ 1.5) and
``time_to_target_ratio`` = project ÷ TRL seconds until the reward, averaged over 5 steps, reaches 0.9 (goal ≤ 0.67).
Prints one JSON object.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import curves  # noqa: E402
import harness  # noqa: E402

GROUP, PROMPTS, MINI_BATCHES, LR, MAX_NEW_TOKENS, EVAL_EVERY = 8, 32, 4, 7e-5, 4, 10
RATE_GOAL, TIME_GOAL = 1.5, 0.67  # ≥ 1.5x TRL's completions/s, ≤ 0.67x its time to target


def project(model: Path, steps: int, seed: int, root: Path) -> dict[str, Any]:
    """The demo as it ships, with the same evaluation cadence as the TRL run."""
    rows = harness.grpo_run(
        [f"run.seed={seed}", f"run.steps={steps}", f"model.path={model}", f"learner.eval_every={EVAL_EVERY}"],
        root / f"project-seed{seed}",
    )
    c = curves.curve(rows)
    return _summary("project", seed, c, GROUP * PROMPTS * len(c["reward"]))  # every step trains a whole batch


def _summary(kind: str, seed: int, c: dict[str, list[float]], completions: int) -> dict[str, Any]:
    seconds = c["seconds"][-1] if c["seconds"] else float("nan")
    return {
        "kind": kind,
        "seed": seed,
        "steps": len(c["reward"]),
        "completions": completions,
        "seconds": seconds,
        "completions_per_s": completions / seconds,
        "time_to_target_s": curves.time_to_target(c),
        **c,
    }


def trl(model_dir: Path, steps: int, seed: int, root: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same model, problems and settings (see the module's docstring)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    from common.config import Config, GraderConfig, TaskConfig
    from common.evaluation import score_problems, summarise
    from common.generation import generate
    from common.tasks import PromptEncoder, make_task
    from grader.builtin import addition
    from grader.pool import open_grader

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renames, inside TRL
    torch.set_num_threads(2)  # the machine's cores; the project's three processes take one each
    torch.manual_seed(seed)
    cfg = Config()
    task = make_task(TaskConfig(), seed)  # the demo's split: 80 training problems, 20 held out
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eos = tokenizer.eos_token_id
    encode = PromptEncoder(tokenizer, cfg.task)
    history: list[tuple[float, float]] = []  # (seconds since training started, the step's mean reward)
    evals: list[tuple[float, float]] = []
    clock = {"start": 0.0}

    def reward(completions: list[str], completion_ids: list[list[int]], reference: list[str], **_: Any) -> list[float]:
        # The project's grading: the answer exactly, and the completion must have ended with end-of-sequence.
        scores = [
            addition(text, ref) if ids and ids[-1] == eos else 0.0
            for text, ids, ref in zip(completions, completion_ids, reference, strict=True)
        ]
        history.append((time.perf_counter() - clock["start"], statistics.fmean(scores)))
        return scores

    with open_grader(GraderConfig()) as grader:

        def evaluate() -> float:
            def greedy(prompts: Any, n: int, _greedy: bool) -> Any:
                return generate(
                    policy, prompts, n=n, max_new_tokens=MAX_NEW_TOKENS, stop_ids=[eos],
                    pad_id=tokenizer.pad_token_id, temperature=None,
                )  # fmt: skip

            policy.eval()
            scores = score_problems(task.eval, encode, greedy, grader, tokenizer, n=0, batch=64, require_stop=True)
            policy.train()
            return float(summarise(scores.greedy, scores.sampled)["pass_at_1"])

        class Clock(TrainerCallback):  # type: ignore[misc]
            def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
                # Step 0's evaluation, before the clock starts, as the project's learner does it.
                with torch.no_grad():
                    evals.append((0.0, evaluate()))
                clock["start"] = time.perf_counter()

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                generation, rest = divmod(state.global_step, MINI_BATCHES)
                if rest == 0 and (generation % EVAL_EVERY == 0 or generation == steps):
                    with torch.no_grad():
                        accuracy = evaluate()
                    evals.append((time.perf_counter() - clock["start"], accuracy))

        args = GRPOConfig(
            output_dir=str(root / f"trl-seed{seed}"),
            seed=seed,
            max_steps=steps * MINI_BATCHES,
            num_generations=GROUP,
            per_device_train_batch_size=GROUP * PROMPTS // MINI_BATCHES,
            steps_per_generation=MINI_BATCHES,
            num_iterations=1,
            gradient_accumulation_steps=1,
            learning_rate=LR,
            lr_scheduler_type="constant",
            warmup_steps=0,
            adam_beta1=0.9,
            adam_beta2=0.99,
            weight_decay=0.0,
            max_grad_norm=1.0,
            loss_type="dapo",
            epsilon=0.2,
            epsilon_high=0.28,
            beta=0.0,
            scale_rewards="group",
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_completion_length=MAX_NEW_TOKENS,
            mask_truncated_completions=False,
            use_cpu=True,
            bf16=False,
            save_strategy="no",
            report_to="none",
            logging_steps=10**9,
            disable_tqdm=True,
            remove_unused_columns=False,
        )
        train = Dataset.from_list([{"prompt": p.prompt, "reference": p.reference} for p in task.train])
        trainer = GRPOTrainer(
            model=policy, reward_funcs=reward, args=args, train_dataset=train, processing_class=tokenizer,
            callbacks=[Clock()],
        )  # fmt: skip
        trainer.remove_callback(PrinterCallback)  # its end-of-training dict would land in the benchmark's output
        # The prompts TRL generates from must be the token ids the project's actors send (the tokenizer's BOS).
        assert tokenizer(task.train[0].prompt)["input_ids"] == encode(task.train[0].prompt)
        trainer.train()
    c = {
        "seconds": [round(t, 3) for t, _ in history],
        "reward": [r for _, r in history],
        "eval_seconds": [round(t, 3) for t, _ in evals],
        "accuracy": [a for _, a in evals],
    }
    return _summary("trl", seed, c, GROUP * PROMPTS * len(history))


def run(quick: bool, png: Path | None = None, steps: int | None = None) -> dict[str, object]:
    from common.tiny_model import ensure_tiny_model

    steps = steps or (40 if quick else 120)
    seeds = (0,) if quick else (0, 1, 2)
    model = ensure_tiny_model(seed=0, eval_size=20)
    runs = []
    with tempfile.TemporaryDirectory(prefix="grpo-bench-trl-") as tmp:
        for seed in seeds:  # alternate, so drift on a noisy machine hits both
            runs.append(project(model, steps, seed, Path(tmp)))
            runs.append(trl(model, steps, seed, Path(tmp)))
    ours = [r for r in runs if r["kind"] == "project"]
    theirs = [r for r in runs if r["kind"] == "trl"]
    rate = statistics.median(p["completions_per_s"] / t["completions_per_s"] for p, t in zip(ours, theirs, strict=True))
    reached = [(p, t) for p, t in zip(ours, theirs, strict=True) if p["time_to_target_s"] and t["time_to_target_s"]]
    result: dict[str, object] = {
        "name": "B2 TRL",
        "target_reward": curves.TARGET,
        "steps": steps,
        "runs": runs,
        "completions_per_s_ratio": rate,
        "completions_per_s_goal": RATE_GOAL,
        "time_to_target_ratio": (
            statistics.median(p["time_to_target_s"] / t["time_to_target_s"] for p, t in reached) if reached else None
        ),
        "time_to_target_goal": TIME_GOAL,
    }
    ttt = result["time_to_target_ratio"]
    result["ok"] = rate >= RATE_GOAL and ttt is not None and ttt <= TIME_GOAL  # type: ignore[operator]
    if png is not None:
        import plots

        result["png"] = str(png) if plots.versus_trl(result, png) else None
    return result


def main() -> int:
    p = harness.parser(__doc__, "one seed of 40 steps per system instead of three of 120")
    p.add_argument("--png", type=Path, default=None)
    p.add_argument("--steps", type=int, default=None, help="learner steps (TRL generations) per run")
    args = p.parse_args()
    return harness.emit(run(args.quick, args.png, args.steps), args.out)


if __name__ == "__main__":
    sys.exit(main())
