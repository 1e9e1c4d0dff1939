"""Learning curves: the demo's reward and held-out accuracy against wall-clock seconds, for three seeds of the
demo as it ships, and for one actor whose round fills a batch run asynchronously and synchronously
(`actor.synchronous=true`, B1's baseline, on the real task), and a PNG of them.

    .venv/bin/python benchmarks/curves.py [--quick] [--out curves.json] [--png curves.png]

Every run is the real `grpo run` on the demo model (seed 0's, so the seeds differ in the held-out split, the
sampling and the order of prompts, not in the starting point). Wall-clock is the sum of the learner's
`time/step_s` from step 1. Also reports each run's seconds to reach the target reward (0.9, averaged over 5 steps)
and, for the pair, synchronous time to target over asynchronous. Prints one JSON object.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import harness  # noqa: E402

TARGET = 0.9


def curve(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Reward and accuracy against seconds of training, from a run's metrics.jsonl rows."""
    t, out = 0.0, {"seconds": [], "reward": [], "eval_seconds": [], "accuracy": []}
    for r in rows:
        t += r.get("time/step_s", 0.0)
        if r["step"] > 0:
            out["seconds"].append(round(t, 3))
            out["reward"].append(r["reward"])
        if "eval/accuracy" in r:
            out["eval_seconds"].append(round(t, 3))
            out["accuracy"].append(r["eval/accuracy"])
    return out


def time_to_target(c: dict[str, list[float]], window: int = 5) -> float | None:
    rewards = c["reward"]
    for i in range(window - 1, len(rewards)):
        if statistics.fmean(rewards[i - window + 1 : i + 1]) >= TARGET:
            return c["seconds"][i]
    return None


def time_to_accuracy(c: dict[str, list[float]], target: float) -> float | None:
    """Seconds until the greedy held-out accuracy first reaches ``target``."""
    return next((t for t, a in zip(c["eval_seconds"], c["accuracy"], strict=True) if a >= target), None)


def mean_accuracy(c: dict[str, Any], horizon: float) -> float:
    """The area under held-out accuracy against seconds, over [0, horizon], divided by it: the mean accuracy over
    that time, each evaluation's accuracy holding until the next one's."""
    times, accs = c["eval_seconds"], c["accuracy"]
    if horizon <= 0:
        return accs[0]
    area = 0.0
    for i, (t, a) in enumerate(zip(times, accs, strict=True)):
        end = min(times[i + 1] if i + 1 < len(times) else horizon, horizon)
        if end > t:
            area += a * (end - t)
    return area / horizon


# One actor, its round a whole batch, nothing filtered: what a synchronous loop needs (see actor.synchronous).
PAIR = ["run.actors=1", "actor.prompts_per_round=32", "learner.batch_groups=32", "actor.filter_zero_std=false"]


def demo(seed: int, steps: int, model: Path, root: Path, synchronous: bool | None = None) -> dict[str, object]:
    """The demo with ``seed``; with ``synchronous`` set, the one-actor pair's setting, run that way."""
    kind = "demo" if synchronous is None else ("sync" if synchronous else "async")
    overrides = [f"run.seed={seed}", f"run.steps={steps}", f"model.path={model}", "learner.eval_every=10"]
    if synchronous is not None:
        overrides += [*PAIR, f"actor.synchronous={str(synchronous).lower()}"]
    c = curve(harness.grpo_run(overrides, root / f"seed{seed}-{kind}"))
    return {"seed": seed, "kind": kind, "synchronous": bool(synchronous), "time_to_target_s": time_to_target(c), **c}


def run(quick: bool, png: Path | None = None) -> dict[str, object]:
    from ops.tiny_model import ensure_tiny_model

    steps = 60 if quick else 200
    model = ensure_tiny_model(seed=0, eval_size=20)
    with tempfile.TemporaryDirectory(prefix="grpo-bench-curves-") as tmp:
        runs = [demo(seed, steps, model, Path(tmp)) for seed in (0, 1, 2)]
        runs += [demo(0, steps, model, Path(tmp), synchronous=s) for s in (False, True)]
    result: dict[str, object] = {"name": "curves", "target_reward": TARGET, "steps": steps, "runs": runs}
    asyn, sync = runs[3]["time_to_target_s"], runs[4]["time_to_target_s"]
    if asyn is not None and sync is not None:
        result["sync_over_async_time_to_target"] = sync / asyn  # type: ignore[operator]
    if png is not None:
        import plots

        result["png"] = str(png) if plots.curves(result, png) else None
    return result


def main() -> int:
    p = harness.parser(__doc__, "60 steps per run instead of 200")
    p.add_argument("--png", type=Path, default=None)
    args = p.parse_args()
    return harness.emit(run(args.quick, args.png), args.out)


if __name__ == "__main__":
    sys.exit(main())
