"""LoRA beside the full recipe: ``configs/smollm2-cpu.yaml`` as it ships, then with ``configs/smollm2-cpu-lora.yaml``
laid over it (a rank-16 adapter on every linear layer, lr 2e-4), one after the other on this machine with the same
seeds, dtype and sizes, each the real ``grpo run``. Per run: greedy held-out accuracy at each evaluation and its
lift (last − step 0), the reward of the first and last two steps, the learner's training time (``time/elapsed_s``
at the last step) and median step (``time/train_s``), the learner's and the actor's peak resident memory (VmHWM,
read every half second), and the bytes of one published version. Then, per seed, LoRA's figures ÷ the full run's.

    .venv/bin/python benchmarks/lora_recipe.py [--seeds 0 1] [--steps 10] [--out result.json]

Run it alone on the machine: the two runs are compared by their times. ``--quick``: the tiny demo model for 3 steps
(a smoke run of the benchmark itself, not a figure).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import harness

REPO = harness.REPO
FULL = [str(REPO / "configs" / "smollm2-cpu.yaml")]
LORA = [*FULL, str(REPO / "configs" / "smollm2-cpu-lora.yaml")]


def peak_rss_mib(pid: int) -> float | None:
    """A process's peak resident memory so far (Linux: VmHWM), None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Peaks(threading.Thread):
    """The peak resident memory of each role's process in a run directory's endpoints, while the run goes on."""

    def __init__(self, run_dir: Path):
        super().__init__(daemon=True)
        self.run_dir, self.peaks, self.done = run_dir, {}, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            for f in (self.run_dir / "endpoints.d").glob("*.json"):
                try:
                    e = json.loads(f.read_text())
                except (OSError, ValueError):
                    continue
                if (mib := peak_rss_mib(int(e["pid"]))) is not None:
                    key = e["role"]
                    self.peaks[key] = max(self.peaks.get(key, 0.0), mib)


def one_run(configs: list[str], overrides: list[str], run_dir: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "common.cli", "run", "--plain"]
    for c in configs:
        cmd += ["--config", c]
    for o in [*overrides, f"run.dir={run_dir}"]:
        cmd += ["-o", o]
    peaks = Peaks(run_dir)
    peaks.start()
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    peaks.done.set()
    if done.returncode != 0:
        raise SystemExit(f"grpo run failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    steps = [r for r in rows if r["step"] > 0]
    last = sorted((run_dir / "weights").glob("v*"))[-1]
    return {
        "eval_accuracy": evals,
        "lift": round(evals[max(evals)] - evals[0], 4),
        "reward_first2": round(statistics.mean(r["reward"] for r in steps[:2]), 3),
        "reward_last2": round(statistics.mean(r["reward"] for r in steps[-2:]), 3),
        "training_s": round(rows[-1]["time/elapsed_s"], 1),
        "train_step_s_median": round(statistics.median(r["time/train_s"] for r in steps), 2),
        "command_s": round(wall, 1),
        "peak_rss_mib": {k: round(v, 1) for k, v in peaks.peaks.items()},
        "version_bytes": sum(f.stat().st_size for f in last.glob("*.safetensors")),
        "version_files": sorted(f.name for f in last.iterdir()),
    }


def ratios(full: dict[str, Any], lora: dict[str, Any]) -> dict[str, float]:
    """LoRA ÷ full for the figures where less is better, and the lifts side by side."""
    return {
        "training_s": round(lora["training_s"] / full["training_s"], 3),
        "train_step_s_median": round(lora["train_step_s_median"] / full["train_step_s_median"], 3),
        "learner_peak_rss": round(lora["peak_rss_mib"]["learner"] / full["peak_rss_mib"]["learner"], 3),
        "version_bytes": round(lora["version_bytes"] / full["version_bytes"], 5),
        "lift_difference": round(lora["lift"] - full["lift"], 4),
    }


def main() -> int:
    p = harness.parser(__doc__, "the tiny demo model for 3 steps: a smoke run, not a figure")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    small = ["model.path=", "run.steps=3", "learner.eval_every=3"] if args.quick else [f"run.steps={args.steps}"]
    per_seed = []
    with tempfile.TemporaryDirectory(prefix="grpo-bench-lora-") as tmp:
        for seed in args.seeds:
            o = [*small, f"run.seed={seed}", "learner.eval_every=2"] if not args.quick else [*small, f"run.seed={seed}"]
            full = one_run(FULL, [*o, "run.name=bench-full"], Path(tmp) / f"full-{seed}")
            lora = one_run(LORA, [*o, "run.name=bench-lora"], Path(tmp) / f"lora-{seed}")
            per_seed.append({"seed": seed, "full": full, "lora": lora, "lora_over_full": ratios(full, lora)})
    return harness.emit({"name": "LoRA recipe beside the full recipe", "steps": args.steps, "runs": per_seed},
                        args.out)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
