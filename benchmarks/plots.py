"""PNG plots of benchmark results (matplotlib, the `bench` extra). Each function returns False, writing nothing,
when matplotlib is not installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt: Any, fig: Any, png: Path) -> bool:
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return True


def _reward_and_accuracy(result: dict[str, Any], png: Path, what: str, runs: list[tuple[dict, str, dict]]) -> bool:
    """Reward against wall-clock beside held-out accuracy against wall-clock, one line per (run, label, style)."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, (ax_r, ax_a) = plt.subplots(1, 2, figsize=(11, 4))
    for run, label, style in runs:
        ax_r.plot(run["seconds"], run["reward"], label=label, linewidth=1, **style)
        ax_a.plot(run["eval_seconds"], run["accuracy"], marker="o", markersize=3, label=label, **style)
    target_axis = ax_r if result.get("target", "reward") == "reward" else ax_a
    # One target, or one per seed (a lift over each seed's untrained accuracy): a grey line each.
    targets = set((result.get("targets") or {}).values()) or {result.get("target_value", result.get("target_reward"))}
    for target in targets:
        target_axis.axhline(target, color="grey", linewidth=0.5)
    ax_r.set(xlabel="wall-clock seconds", ylabel="reward (every sampled completion)", title=f"{what}: reward")
    ax_a.set(xlabel="wall-clock seconds", ylabel="greedy held-out accuracy", title=f"{what}: eval/accuracy")
    ax_r.legend(fontsize=8)
    return _save(plt, fig, png)


def curves(result: dict[str, Any], png: Path) -> bool:
    """Demo reward and held-out accuracy against wall-clock: the seeds, and the synchronous run dashed."""
    styles = {"demo": {}, "async": {"color": "black"}, "sync": {"color": "tab:red", "linestyle": "--"}}
    runs = []
    for run in result["runs"]:
        kind = run.get("kind", "demo")
        label = f"seed {run['seed']}" if kind == "demo" else f"1 actor, {'synchronous' if kind == 'sync' else 'async'}"
        runs.append((run, label, styles[kind]))
    return _reward_and_accuracy(result, png, "demo", runs)


def overlap(result: dict[str, Any], png: Path) -> bool:
    """B1: seconds per step, synchronous and asynchronous, with the ideal max(g, t), for each g / t."""
    plt = _pyplot()
    if plt is None:
        return False
    cases = result["cases"]
    x = range(len(cases))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([i - 0.2 for i in x], [c["sync_s_per_step"] for c in cases], 0.4, label="synchronous")
    ax.bar([i + 0.2 for i in x], [c["async_s_per_step"] for c in cases], 0.4, label="asynchronous")
    ax.scatter([i + 0.2 for i in x], [max(c["g_s"], c["t_s"]) for c in cases], color="black", marker="_", s=400,
               label="ideal max(g, t)", zorder=3)  # fmt: skip
    ax.set_xticks(list(x), [f"g/t = {c['g_over_t']:g}" for c in cases])
    ax.set(ylabel="seconds per learner step", title="B1 overlap")
    ax.legend(fontsize=8)
    return _save(plt, fig, png)


def scale(result: dict[str, Any], png: Path) -> bool:
    """B5: groups/s trained against K actors, with K x one actor's."""
    plt = _pyplot()
    if plt is None:
        return False
    cases = result["cases"]
    k = [c["actors"] for c in cases]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(k, [c["ideal_groups_per_s"] for c in cases], color="grey", linestyle="--", label="K x one actor")
    ax.plot(k, [c["groups_per_s"] for c in cases], marker="o", label="measured at the learner")
    ax.set(xscale="log", yscale="log", xlabel="actors K", ylabel="groups/s trained", title="B5 scale")
    ax.set_xticks(k, [str(v) for v in k])
    ax.legend(fontsize=8)
    return _save(plt, fig, png)


def versus_trl(result: dict[str, Any], png: Path) -> bool:
    """B2: reward and held-out accuracy against wall-clock, the project's demo and TRL's GRPOTrainer, each seed."""
    colors = {"project": "tab:blue", "nofilter": "tab:green", "trl": "tab:orange"}
    names = {"project": "grpo-pipeline", "nofilter": "grpo-pipeline, no zero-std filter", "trl": "TRL GRPOTrainer"}
    runs = [
        (
            run,
            f"{names[run['kind']]} seed {run['seed']}",
            {"color": colors[run["kind"]], "alpha": 1.0 if run["seed"] == 0 else 0.5},
        )
        for run in result["runs"]
    ]
    return _reward_and_accuracy(result, png, f"B2 ({result.get('setting', 'demo')})", runs)
