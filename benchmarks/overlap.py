"""B1 overlap: the asynchronous pipeline against the same system run synchronously, for generation time g and
learner step time t with g / t in {0.25, 1, 4}.

    .venv/bin/python benchmarks/overlap.py [--quick] [--out result.json]

Each measurement is a real `grpo run` (one learner, one actor, a private Redis): the `sim` engine generates a
round of random tokens at a rate set so that a round takes g on average, and the learner trains the tiny model on
it, padded to t (`learner.min_step_s`). One round is one batch. Synchronously (`actor.synchronous=true`) the actor
waits for the weights of each step before sampling the next round, so a step costs about g + t; asynchronously it
samples while the learner trains, so a step ideally costs max(g, t). The figure is the measured speedup (synchronous
seconds per step ÷ asynchronous) as a fraction of that ideal, (g + t) / max(g, t); goal ≥ 0.9. Seconds per step
are the median of the learner's `time/step_s` after the first steps. Each case also gives the asynchronous
learner's idle fraction (time waiting for groups ÷ step time); at g/t = 0.25 the actors are ample and it should stay
under 5 %. Prints one JSON object.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import harness

STEP_S = 0.4  # t
GROUP, PROMPTS, MAX_TOKENS = 4, 4, 8
COMMON = [
    "run.actors=1",
    "actor.engine=sim",
    "actor.filter_zero_std=false",  # random tokens all score 0: every group would be filtered
    f"sampling.group_size={GROUP}",
    f"actor.prompts_per_round={PROMPTS}",
    f"learner.batch_groups={PROMPTS}",  # one round is one batch
    f"actor.max_stream_groups={PROMPTS}",  # at most one batch waits: staleness stays within the bound below
    "learner.max_staleness=4",
    "learner.updates_per_batch=1",
    f"sampling.max_new_tokens={MAX_TOKENS}",
    f"learner.min_step_s={STEP_S}",
    "learner.eval_every=1000000",
    "checkpoint.every=1000000",
    "grader.isolation=inline",
]


def seconds_per_step(g: float, synchronous: bool, steps: int, root: Path) -> tuple[float, float, float]:
    """Median seconds per step, the largest staleness trained on (0 when synchronous), and the fraction of the
    learner's time spent waiting for groups."""
    # The sim engine's round has PROMPTS x GROUP completions of 1..MAX_TOKENS tokens, (MAX_TOKENS + 1) / 2 on average.
    rate = PROMPTS * GROUP * (MAX_TOKENS + 1) / 2 / g
    overrides = [*COMMON, f"run.steps={steps}", f"actor.sim_tokens_per_s={rate}",
                 f"actor.synchronous={str(synchronous).lower()}"]  # fmt: skip
    rows = harness.grpo_run(overrides, root / f"g{g}-{'sync' if synchronous else 'async'}", timeout_s=900)
    warm = [r for r in rows if r["step"] > 2]  # after the first steps (loading, first rounds)
    idle = sum(r["time/wait_s"] for r in warm) / sum(r["time/step_s"] for r in warm)
    return (
        statistics.median(r["time/step_s"] for r in warm),
        max(r["staleness/max"] for r in rows if r["step"] > 0),
        idle,
    )


def run(quick: bool, ratios: tuple[float, ...] = (0.25, 1.0, 4.0), steps: int | None = None) -> dict[str, object]:
    steps = steps or (12 if quick else 30)
    cases = []
    with tempfile.TemporaryDirectory(prefix="grpo-bench-overlap-") as tmp:
        for ratio in ratios:
            g = ratio * STEP_S
            sync, sync_staleness, _ = seconds_per_step(g, True, steps, Path(tmp))
            asyn, async_staleness, async_idle = seconds_per_step(g, False, steps, Path(tmp))
            ideal = (g + STEP_S) / max(g, STEP_S)
            cases.append(
                {
                    "g_over_t": ratio,
                    "g_s": g,
                    "t_s": STEP_S,
                    "sync_s_per_step": sync,
                    "async_s_per_step": asyn,
                    "speedup": sync / asyn,
                    "ideal_speedup": ideal,
                    "fraction_of_ideal": sync / asyn / ideal,
                    "goal": 0.9,
                    "sync_staleness_max": sync_staleness,
                    "async_staleness_max": async_staleness,
                    # With g < t the actors are ample: the learner should (almost) never wait (goal < 5 %).
                    "async_learner_idle_fraction": async_idle,
                }
            )
    return {"name": "B1 overlap", "cases": cases, "ok": all(c["fraction_of_ideal"] >= 0.9 for c in cases)}


def main() -> int:
    p = harness.parser(__doc__, "fewer steps per run")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.25, 1.0, 4.0], help="values of g / t")
    p.add_argument("--steps", type=int, default=None, help="learner steps per run (default 12 quick, 30 full)")
    args = p.parse_args()
    return harness.emit(run(args.quick, tuple(args.ratios), args.steps), args.out)


if __name__ == "__main__":
    sys.exit(main())
