"""Run the demo under each staleness bound and old-log-prob mode, and print the table of docs/objective.md.

    .venv/bin/python scripts/off_policy_sweep.py [--out runs/sweep] [-o key=value ...]
    .venv/bin/python scripts/off_policy_sweep.py --table runs/sweep/sweep.json    # the table of a finished sweep

Each run is a plain `grpo run` with `learner.max_staleness` in {0, 1, 2, 4} and `learner.old_logprobs` in
{proximal, behavior} (plus the mask importance-weight mode at staleness 2), one after another on this machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

RUNS = [(s, mode, "truncate") for s in (0, 1, 2, 4) for mode in ("proximal", "behavior")] + [(2, "proximal", "mask")]


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def one_run(out: Path, staleness: int, mode: str, is_mode: str, extra: list[str]) -> dict:
    name = f"s{staleness}-{mode}-{is_mode}"
    overrides = [f"run.name={name}", f"run.dir={out / name}", f"learner.max_staleness={staleness}",
                 f"learner.old_logprobs={mode}", f"learner.is_mode={is_mode}", *extra]  # fmt: skip
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "common.cli", "run", "--plain", *[a for o in overrides for a in ("-o", o)]]
    code = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    wall = time.perf_counter() - t0
    summary = json.loads((out / name / "summary.json").read_text()) if code == 0 else {}
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    return {
        "max_staleness": staleness,
        "old_logprobs": mode,
        "is_mode": is_mode if mode == "proximal" else "-",
        "exit": code,
        "wall_s": wall,
        "reward_last10": summary.get("reward_last10"),
        "eval_accuracy_final": summary.get("eval_accuracy_final"),
        "staleness_mean": mean([r["staleness/mean"] for r in steps]),
        "staleness_max": max((r["staleness/max"] for r in steps), default=None),
        "dropped_stale": summary.get("groups_dropped", {}).get("stale", 0),
        "is_weight_mean": mean([r["is_weight/mean"] for r in steps if "is_weight/mean" in r]),
        "is_weight_max": max((r["is_weight/max"] for r in steps if "is_weight/max" in r), default=None),
        "is_truncated_frac": mean([r["is_weight/truncated_frac"] for r in steps if "is_weight/truncated_frac" in r]),
        "mismatch": mean([r["mismatch/logprob_abs_mean"] for r in steps if "mismatch/logprob_abs_mean" in r]),
    }


def fmt(v: object, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/sweep", type=Path)
    p.add_argument("-o", "--override", action="append", default=[])
    p.add_argument("--table", type=Path, help="print the table of a finished sweep's sweep.json and exit")
    args = p.parse_args()
    if args.table:
        print_table(json.loads(args.table.read_text()))
        return 0
    results = []
    for staleness, mode, is_mode in RUNS:
        results.append(one_run(args.out, staleness, mode, is_mode, args.override))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    (args.out / "sweep.json").write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    return 0 if all(r["exit"] == 0 for r in results) else 1


def print_table(results: list[dict]) -> None:
    print("| max_staleness | old_logprobs | is_mode | reward, last 10 | eval/accuracy | staleness mean / max "
          "| dropped stale | is_weight mean / max | truncated | mismatch | wall |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['max_staleness']} | {r['old_logprobs']} | {r['is_mode']} | {fmt(r['reward_last10'])} "
            f"| {fmt(r['eval_accuracy_final'], '.2f')} "
            f"| {fmt(r['staleness_mean'], '.2f')} / {fmt(r['staleness_max'], '.0f')} "
            f"| {r['dropped_stale']} | {fmt(r['is_weight_mean'])} / {fmt(r['is_weight_max'], '.2f')} "
            f"| {fmt(r['is_truncated_frac'], '.4f')} | {fmt(r['mismatch'], '.1e')} | {r['wall_s']:.0f} s |"
        )


if __name__ == "__main__":
    sys.exit(main())
