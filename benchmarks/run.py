"""All benchmarks in one command: each measures the project against its baseline in the same run and prints
ratios, never absolute-time claims. Results go to ``benchmarks/results/<date>.json``.

    .venv/bin/python benchmarks/run.py --quick      # about 6 minutes on 2 cores
    .venv/bin/python benchmarks/run.py              # longer runs, steadier figures
    .venv/bin/python benchmarks/run.py --only B3 B4

- B1 overlap (benchmarks/overlap.py): asynchronous vs synchronous pipeline, as a fraction of the ideal speedup.
- B2 TRL (benchmarks/versus_trl.py): the demo against TRL's GRPOTrainer, completions/s and time to target.
- B3 transport (benchmarks/transport.py): the project's group path vs raw Redis stream commands.
- B4 weights (benchmarks/weights.py): publish + load vs raw safetensors save + load; and to K actors
  (benchmarks/broadcast.py): weights.transport nccl's broadcast vs the disk path.
- B5 scale (benchmarks/scale.py): groups/s at the learner with K actors vs K x one actor's.
- B6 engines (benchmarks/engines.py): one actor's generation with a real SGLang server vs the local engine, on the
  demo's workload, or a recipe's with GRPO_BENCH_CONFIG (e.g. configs/smollm2-cpu.yaml).
- B7 in-flight updates (benchmarks/in_flight.py): weights loaded between rounds vs in flight, on long answers:
  actor and learner idle time, mean token staleness, completions/s.
- curves (benchmarks/curves.py): the demo's reward and accuracy against wall-clock, three seeds, and synchronous.

PNG plots of B1, B2, B5 and the curves go beside the report (``<date>-b1.png`` ...) when matplotlib is installed
(the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(1, str(REPO))

import broadcast  # noqa: E402
import curves  # noqa: E402
import engines  # noqa: E402
import in_flight  # noqa: E402
import overlap  # noqa: E402
import plots  # noqa: E402
import scale  # noqa: E402
import transport  # noqa: E402
import versus_trl  # noqa: E402
import weights  # noqa: E402

from common.hardware import machine  # noqa: E402

BENCHMARKS = {
    "B1": overlap.run,
    "B2": versus_trl.run,
    "B3": transport.run,
    "B4": weights.run,
    "B4-broadcast": broadcast.run,
    "B5": scale.run,
    "B6": lambda quick: engines.run(quick, [c for c in [os.environ.get("GRPO_BENCH_CONFIG", "")] if c]),
    "B7": in_flight.run,
    "curves": curves.run,
}
PLOTS = {"B1": plots.overlap, "B2": plots.versus_trl, "B5": plots.scale, "curves": plots.curves}


def lines(name: str, result: dict) -> list[str]:
    """One line per figure, with its goal."""
    out = []
    if name == "B1":
        for c in result["cases"]:
            out.append(f"B1 overlap g/t={c['g_over_t']:<5} speedup {c['speedup']:.2f} of ideal "
                       f"{c['ideal_speedup']:.2f} = {c['fraction_of_ideal']:.2f}  (goal >= {c['goal']}); learner "
                       f"idle {c['async_learner_idle_fraction']:.1%}")  # fmt: skip
    elif name == "B2":
        ttt = result["time_to_target_ratio"]
        out.append(f"B2 TRL completions/s: {result['completions_per_s_ratio']:.2f} x TRL's  (goal >= "
                   f"{result['completions_per_s_goal']})")  # fmt: skip
        target = f"{result.get('target', 'reward')} {result.get('target_value', result['target_reward'])}"
        out.append(f"B2 TRL time to {target}: "
                   f"{'not reached' if ttt is None else f'{ttt:.2f}'} x TRL's  (goal <= "
                   f"{result['time_to_target_goal']})")  # fmt: skip
    elif name == "B3":
        for c in result["cases"]:
            out.append(f"B3 transport 16 x {c['completion_tokens']} tokens: {c['ratio']:.2f} x raw  (goal >= "
                       f"{c['goal']})")  # fmt: skip
    elif name == "B4":
        out.append(f"B4 weights {result['parameters'] / 1e6:.0f}M params: {result['ratio']:.2f} x raw  "
                   f"(goal >= {result['goal']})")  # fmt: skip
    elif name == "B4-broadcast":
        for c in result["cases"]:
            out.append(f"B4 weights to {c['receivers']} actors over {result['backend']}: broadcast {c['ratio']:.2f} x "
                       f"as fast as disk ({c['broadcast_s']:.2f} s vs {c['disk_s']:.2f} s; no goal)")  # fmt: skip
    elif name == "B6":
        for c in result["cases"]:
            ratios = ", ".join(f"{k} in flight {r:.2f}" for k, r in c["completions_per_s_ratio"].items())
            out.append(f"B6 engines, {c['case']} on {result['machine']['cpu']}: SGLang ÷ local completions/s: "
                       f"{ratios} (no goal)")  # fmt: skip
    elif name == "B7":
        for c in result["cases"]:
            out.append(f"B7 in-flight updates, answers of up to {c['max_new_tokens']} tokens: in flight ÷ between "
                       f"rounds: token staleness {c['token_staleness_mean_ratio']:.2f}, actor idle "
                       f"{c['actor_idle_frac_ratio']:.2f}, completions/s {c['completions_per_s_ratio']:.2f} (goal: "
                       "staleness and actor idle < 1)")  # fmt: skip
    elif name == "curves":
        for r in result["runs"]:
            out.append(f"curves seed {r['seed']} {r['kind']}: reward {result['target_reward']} after "
                       f"{r['time_to_target_s']} s")  # fmt: skip
        if "sync_over_async_time_to_target" in result:
            out.append(
                f"curves time to target, synchronous / asynchronous: {result['sync_over_async_time_to_target']:.2f}"
            )
    elif name == "B5":
        for c in result["cases"]:
            out.append(f"B5 scale K={c['actors']:<3} {c['groups_per_s']:.1f} groups/s = {c['ratio']:.2f} x K x one "
                       f"actor's  (goal >= {c['goal']}; learner waiting {c['learner_wait_fraction']:.0%})")  # fmt: skip
    return out


def draw(report: dict, out: Path) -> None:
    """PNGs beside the report (<date>-b1.png, ...) for the results that have a plot."""
    for name, result in report["results"].items():
        if name in PLOTS:
            png = out.with_name(f"{out.stem}-{name.lower()}.png")
            result["png"] = png.name if PLOTS[name](result, png) else None


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="shorter runs (about 6 minutes on 2 cores)")
    p.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), default=sorted(BENCHMARKS))
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/<date>.json")
    p.add_argument("--replot", type=Path, metavar="REPORT", help="only redraw the PNGs of an existing report")
    args = p.parse_args()
    if args.replot:
        report = json.loads(args.replot.read_text())
        draw(report, args.replot)
        args.replot.write_text(json.dumps(report, indent=2) + "\n")
        return 0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    report: dict = {
        "date": datetime.date.today().isoformat(),
        "commit": commit.stdout.strip() or None,
        "quick": args.quick,
        "machine": {
            **machine(),  # the CPU's model and features, cores, load: what every figure below was measured on
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "results": {},
    }
    t0 = time.perf_counter()
    for name in args.only:
        t = time.perf_counter()
        result = BENCHMARKS[name](args.quick)
        result["seconds"] = round(time.perf_counter() - t, 1)
        report["results"][name] = result
        for line in lines(name, result):
            print(line, flush=True)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    out = args.out or REPO / "benchmarks" / "results" / f"{report['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and set(args.only) != set(BENCHMARKS):
        # A partial rerun (--only) updates its benchmarks in the day's report and keeps the others' figures.
        earlier = json.loads(out.read_text())
        report["results"] = {**earlier.get("results", {}), **report["results"]}
        report["partial_reruns"] = [*earlier.get("partial_reruns", []), {"only": args.only, "commit": report["commit"]}]
    draw(report, out)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out} ({report['seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
