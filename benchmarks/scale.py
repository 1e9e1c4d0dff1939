"""B5 scale: K = 1, 2, 4, 8, 16 simulated actors against one learner — groups per second trained at the learner
against K times what one actor delivers alone, measured in the same run.

    .venv/bin/python benchmarks/scale.py [--quick] [--actors 1 2 4 8 16] [--out result.json]

Each K is a real `grpo run` (a private Redis, one learner on the tiny model, K `grpo actor` processes with the
`sim` engine producing about 4 groups/s each). Groups/s at the learner is the groups it trained over the time its
steps took, after the first steps; the figure is groups/s(K) ÷ (K × groups/s(1)), goal ≥ 0.9 until a bound: the
learner's own step rate, Redis, or — on a small machine — the CPU cores the K processes share. Each case also
reports the learner's wait fraction (time waiting for groups ÷ step time: near 0 means the learner is the bound)
and groups dropped as stale. Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import harness

GROUP, PROMPTS, MAX_TOKENS, BATCH = 4, 2, 8, 8
ROUND_S = 0.5  # one actor's round: PROMPTS groups every ROUND_S seconds, 4 groups/s
COMMON = [
    "actor.engine=sim",
    "actor.filter_zero_std=false",  # random tokens all score 0: every group would be filtered
    f"sampling.group_size={GROUP}",
    f"actor.prompts_per_round={PROMPTS}",
    f"actor.sim_tokens_per_s={PROMPTS * GROUP * (MAX_TOKENS + 1) / 2 / ROUND_S}",
    f"learner.batch_groups={BATCH}",
    "learner.updates_per_batch=1",
    # Steps come faster as actors are added (one version per step): a bound in versions would then drop more and
    # more groups as stale, measuring the staleness policy rather than the pipeline's scaling.
    "learner.max_staleness=16",
    f"sampling.max_new_tokens={MAX_TOKENS}",
    "learner.eval_every=1000000",
    "checkpoint.every=1000000",
    "grader.isolation=inline",
    "run.heartbeat_ttl_s=60",
]


def measure(k: int, seconds: float, root: Path) -> dict[str, float]:
    per_s = k * PROMPTS / ROUND_S
    steps = max(8, int(per_s * seconds / BATCH))
    run_dir = root / f"k{k}"
    rows = harness.grpo_run([*COMMON, f"run.actors={k}", f"run.steps={steps}"], run_dir)
    warm = [r for r in rows if r["step"] > max(2, len(rows) // 4)]  # after start-up: every actor is producing
    seconds_total = sum(r["time/step_s"] for r in warm)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "actors": k,
        "steps_measured": len(warm),
        "groups_per_s": len(warm) * BATCH / seconds_total,
        "learner_wait_fraction": sum(r["time/wait_s"] for r in warm) / seconds_total,
        "groups_dropped": sum((summary.get("groups_dropped") or {}).values()),
    }


def run(quick: bool, actors: tuple[int, ...] = (1, 2, 4, 8, 16), seconds: float | None = None) -> dict[str, object]:
    seconds = seconds or (12.0 if quick else 40.0)
    with tempfile.TemporaryDirectory(prefix="grpo-bench-scale-") as tmp:
        cases = [measure(k, seconds, Path(tmp)) for k in actors]
    one = next((c["groups_per_s"] for c in cases if c["actors"] == 1), PROMPTS / ROUND_S)
    for c in cases:
        c["ideal_groups_per_s"] = c["actors"] * one
        c["ratio"] = c["groups_per_s"] / c["ideal_groups_per_s"]
        c["goal"] = 0.9
    bend = next((c["actors"] for c in cases if c["ratio"] < 0.9), None)
    return {"name": "B5 scale", "cpus": os.cpu_count(), "one_actor_groups_per_s": one, "cases": cases,
            "bends_at": bend}  # fmt: skip


def main() -> int:
    p = harness.parser(__doc__, "shorter runs")
    p.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--seconds", type=float, default=None, help="measured seconds per K (default 12 quick, 40 full)")
    args = p.parse_args()
    return harness.emit(run(args.quick, tuple(args.actors), args.seconds), args.out)


if __name__ == "__main__":
    sys.exit(main())
