"""B7 in-flight weight updates: ``actor.weight_updates`` between_rounds against in_flight on long answers, as ratios
measured in the same run.

    .venv/bin/python benchmarks/in_flight.py [--quick] [--lengths 256 1024] [--steps 24] [--out result.json]

Each measurement is a real `grpo run` (one learner, one actor, a private Redis). The actor's `sim` engine stands in
for a SGLang server with two rounds in flight (``actor.sim_rounds_in_flight=2``, SGLang's default
``sglang.rounds_in_flight``): each round of 4 prompts × 8 answers of 1..L tokens (L = ``sampling.max_new_tokens``) is
paced as a batched decoder at a rate set so that a round takes about one learner step, and the learner trains the
tiny model (its positions raised to hold the answers) on it, each step padded to at least ``learner.min_step_s``.
Training on long answers takes longer than the floor (about 15 s a step at 1,024 tokens on 2 cores), and a learner
far slower than its actor leaves both modes waiting for room with nothing in flight, so a short pilot run first
measures the learner's step at each length and the floor (and with it the pace) is set 25 % above it.
Between rounds, the actor lets both rounds finish before it loads a version (no request of its own may straddle
an update), so its capacity idles while the longer one ends; in flight, it loads the version at once and the rest of
each answer comes from it.

Per run, after the first steps: the actor's idle share (1 − the seconds its rounds spent generating ÷ (2 × its
wall-clock seconds), from its own last log line), the learner's (waiting for a batch ÷ step time), the mean age of
the trained tokens in versions (``staleness/token_mean``, averaged over steps), completions trained per second,
and the share of groups dropped as stale. The ratios are in flight ÷ between rounds. Prints one JSON object.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import harness

GROUP, PROMPTS, ROUNDS = 8, 4, 2
STEP_S = 1.5  # the learner step's least floor (t); a round takes about as long at the rate below
PILOT_STEPS = 5
COMMON = [
    "run.actors=1",
    "actor.engine=sim",
    f"actor.sim_rounds_in_flight={ROUNDS}",
    "actor.filter_zero_std=false",  # random tokens all score 0: every group would be filtered
    f"sampling.group_size={GROUP}",
    f"actor.prompts_per_round={PROMPTS}",
    f"learner.batch_groups={PROMPTS * ROUNDS}",  # the two rounds in flight make one batch
    "learner.updates_per_batch=1",
    "learner.eval_every=1000000",
    "checkpoint.every=1000000",
    "grader.isolation=inline",
]
_SPLIT = re.compile(r"([\d.]+) s: ([\d.]+) s generating, ([\d.]+) s waiting for room")


def long_model(root: Path, positions: int) -> Path:
    """The demo's tiny model, untrained, with room for ``positions`` tokens (rotary positions: only the config)."""
    if str(harness.REPO) not in sys.path:
        sys.path.insert(0, str(harness.REPO))
    from ops.tiny_model import make_tiny_model

    path = root / "model"
    make_tiny_model(path, warm=False)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def actor_idle(run_dir: Path) -> tuple[float, float]:
    """(idle share, seconds waiting for room) of the actor, from its last log line."""
    for log in sorted((run_dir / "logs").glob("actor-*.log")):
        found = _SPLIT.findall(log.read_text())
        if found:
            wall, generating, waiting = map(float, found[-1])
            return 1.0 - generating / (ROUNDS * wall), waiting
    raise SystemExit(f"no actor time split in {run_dir / 'logs'}")


def step_floor(length: int, model: Path, root: Path) -> float:
    """The learner's step at this length, measured (generation far faster, no floor), plus 25 %; at least STEP_S."""
    rows = harness.grpo_run([*COMMON, f"model.path={model}", f"run.steps={PILOT_STEPS}",
                             f"sampling.max_new_tokens={length}", "learner.min_step_s=0",
                             "actor.sim_tokens_per_s=10000000"], root / f"pilot-{length}", timeout_s=1800)  # fmt: skip
    train = sorted(r["time/step_s"] - r["time/wait_s"] for r in rows if r["step"] > 1 and "loss" in r)
    return max(STEP_S, 1.25 * train[len(train) // 2])


def measure(mode: str, length: int, steps: int, floor: float, model: Path, root: Path) -> dict[str, Any]:
    tokens_per_round = PROMPTS * GROUP * (length + 1) / 2  # answers of 1..L tokens, (L + 1) / 2 on average
    run_dir = root / f"{mode}-{length}"
    pace = [f"learner.min_step_s={floor:.2f}", f"actor.sim_tokens_per_s={tokens_per_round / floor:.0f}"]
    rows = harness.grpo_run([*COMMON, *pace, f"model.path={model}", f"run.steps={steps}",
                             f"sampling.max_new_tokens={length}", f"actor.weight_updates={mode}"], run_dir,
                            timeout_s=1800)  # fmt: skip
    warm = [r for r in rows if r["step"] > 2 and "loss" in r]  # (not the evaluation-only rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    idle, waiting = actor_idle(run_dir)
    span = warm[-1]["time/elapsed_s"] - warm[0]["time/elapsed_s"]
    return {
        "mode": mode,
        "max_new_tokens": length,
        "actor_idle_frac": idle,
        "actor_waiting_for_room_s": waiting,
        "learner_idle_frac": sum(r["time/wait_s"] for r in warm) / sum(r["time/step_s"] for r in warm),
        "token_staleness_mean": sum(r["staleness/token_mean"] for r in warm) / len(warm),
        "group_staleness_mean": sum(r["staleness/mean"] for r in warm) / len(warm),
        "versions_per_answer": sum(r["versions/per_answer"] for r in warm) / len(warm),
        "tokens_stale_masked": sum(r.get("tokens/stale_masked", 0.0) for r in warm),
        "completions_per_s": sum(r["groups_consumed"] for r in warm[1:]) * GROUP / span,
        "dropped_stale_frac": summary["groups_dropped"].get("stale", 0) / max(summary["groups_produced"], 1),
        "steps": steps,
        "learner_step_floor_s": floor,
    }


def run(quick: bool, lengths: tuple[int, ...] = (256, 1024), steps: int | None = None) -> dict[str, Any]:
    lengths = (64,) if quick else lengths
    cases = []
    with tempfile.TemporaryDirectory(prefix="grpo-bench-in-flight-") as tmp:
        model = long_model(Path(tmp), max(lengths) + 64)
        for length in lengths:
            n = steps or (8 if quick else 24 if length <= 256 else 12)  # long steps are slow: fewer of them
            floor = STEP_S if quick else step_floor(length, model, Path(tmp))
            before = measure("between_rounds", length, n, floor, model, Path(tmp))
            after = measure("in_flight", length, n, floor, model, Path(tmp))
            keys = ("actor_idle_frac", "learner_idle_frac", "token_staleness_mean", "completions_per_s")
            ratios = {f"{k}_ratio": after[k] / before[k] if before[k] else None for k in keys}
            cases.append({"max_new_tokens": length, "between_rounds": before, "in_flight": after, **ratios})
    ok = all(c["in_flight"]["token_staleness_mean"] < c["between_rounds"]["token_staleness_mean"]
             and c["in_flight"]["actor_idle_frac"] < c["between_rounds"]["actor_idle_frac"] for c in cases)  # fmt: skip
    return {"name": "B7 in-flight updates", "cases": cases, "ok": ok}


def main() -> int:
    p = harness.parser(__doc__, "answers of up to 64 tokens, 8 steps per run")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024], help="sampling.max_new_tokens of each case")
    p.add_argument("--steps", type=int, default=None, help="learner steps per run (8 quick; 24, above 256 tokens 12)")
    args = p.parse_args()
    return harness.emit(run(args.quick, tuple(args.lengths), args.steps), args.out)


if __name__ == "__main__":
    sys.exit(main())
