"""How far along a run is, in words: the clock, the ETA from the learner's recent steps, and the one-line summary of
a step. The learner writes that line to its log (what ``docker compose logs learner`` shows of a run) and ``grpo
run``'s plain view prints the same figures, so both read alike."""

from __future__ import annotations

from typing import Any

_RATE_WINDOW = 20  # steps the ETA's rate is measured over: recent enough to follow a change of pace


def clock(seconds: float | None) -> str:
    """``42`` → ``0:42``, ``3725`` → ``1:02:05``; None → ``-``."""
    if seconds is None:
        return "-"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def eta_s(rows: list[dict[str, Any]], steps: int) -> float | None:
    """Seconds until step ``steps``, at the learner's rate over its last steps (``time/elapsed_s`` of its rows);
    None before the first step."""
    trained = [r for r in rows if r.get("step", 0) > 0 and "time/elapsed_s" in r]
    if not trained:
        return None
    last = trained[-1]
    first = trained[max(0, len(trained) - 1 - _RATE_WINDOW)]
    if last["step"] > first["step"]:
        per_step = (last["time/elapsed_s"] - first["time/elapsed_s"]) / (last["step"] - first["step"])
    else:  # one step so far: its own time, less its wait for the actors' first groups (start-up, not the pace)
        per_step = last.get("time/step_s", 0.0) - last.get("time/wait_s", 0.0)
    return max(0, steps - last["step"]) * per_step


def fmt(v: Any, spec: str = ".3f") -> str:
    """A figure as ``spec`` formats it; ``-`` for one not known yet (None)."""
    return "-" if v is None else format(v, spec)


def step_line(row: dict[str, Any], steps: int, accuracy: float | None, elapsed: float, eta: float | None) -> str:
    """``step   12/200  reward 0.412  accuracy 0.85  zero-std 0.12  staleness 0.50  1.3 groups/s  elapsed 0:31  eta
    1:23``, from a trained step's row (metrics.jsonl), the newest held-out accuracy (None before the first
    evaluation), the seconds since the start and the ETA."""
    return (
        f"step {row['step']:>4}/{steps}  reward {row['reward']:.3f}  accuracy {fmt(accuracy, '.2f')}  "
        f"zero-std {row['frac_reward_zero_std']:.2f}  staleness {row['staleness/mean']:.2f}  "
        f"{row['groups_per_s']:.1f} groups/s  elapsed {clock(elapsed)}  eta {clock(eta)}"
    )
