"""What ``grpo run`` shows: a live view while it runs (or plain lines when stdout is not a terminal), then a summary.

Both say how long the run has taken and, once steps are being trained, how long it will still take (the ETA, from
the learner's recent step rate). Until the first step they say what the run waits for: its processes to start, the
learner to load the model and evaluate step 0, the actors' first groups (:func:`waiting_for`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from common.config import Config
from common.step_line import clock, eta_s, fmt, step_line
from common.transport import choices_of

_PLAIN_EVERY_S = 5.0


@dataclass(frozen=True)
class Startup:
    """What ``grpo run`` can observe of its processes' start-up (endpoint files, metrics rows, Redis)."""

    missing: list[str]  # processes whose endpoint is not registered yet (they are still importing their libraries)
    started: int  # processes started
    announced: bool  # the learner announced its first weights: its model is loaded
    evaluated: bool  # the learner's step-0 row is written: it waits for groups
    actors: int  # actor processes grpo run started (run.actors)
    actors_ready: int  # of them, heartbeating: their engine is up and their model loaded
    produced: int  # groups the actors have sent
    batch: int  # groups the first step takes (learner.batch_groups)


def waiting_for(s: Startup) -> tuple[str, str]:
    """``(phase, line)``: what the run waits for before its first step, in words. The phase names the stage (the
    line's counts change within it)."""
    if s.missing:
        up = s.started - len(s.missing)
        names = ", ".join("the learner" if name == "learner" else name for name in s.missing)
        return "processes", f"waiting for {names} to start ({up} of {s.started} up)"
    actors = f"; {s.actors_ready} of {s.actors} actors have loaded the model" if s.actors_ready < s.actors else ""
    if not s.announced:
        return "model", f"waiting for the learner to load the model{actors}"
    if not s.evaluated:
        return "evaluation", f"waiting for the learner to evaluate step 0{actors}"
    if s.produced >= s.batch:  # the groups are there: a real model's first step takes a while to train
        return "training", f"the learner is training step 1 ({s.produced} groups sent, {s.batch} a step){actors}"
    whose = "the actors' first groups" if s.actors else "groups from the actors you start (run.actors=0)"
    return "groups", f"waiting for {whose}: {s.produced} of the {s.batch} that step 1 takes{actors}"


def passed_over(choices: dict[str, int]) -> str:
    """``passed over 300 of 420 positions (solved 280, unsolved 20)``: difficulty sampling's choices in words."""
    taken = sum(choices_of("taken", choices).values())
    passed = {pool: n for pool, n in choices_of("passed", choices).items() if n}
    each = f" ({', '.join(f'{k} {n}' for k, n in sorted(passed.items()))})" if passed else ""
    return f"passed over {sum(passed.values())} of {taken + sum(passed.values())} positions{each}"


class Progress:
    def __init__(self, cfg: Config, live: bool, started: float | None = None):
        self.cfg = cfg
        self.console = Console()
        self.live_enabled = live
        self._live: Live | None = None
        self.started = time.perf_counter() if started is None else started  # perf_counter of grpo run's start
        self.rows: list[dict[str, Any]] = []
        self.last: dict[str, Any] = {}
        self.accuracy: float | None = None
        self.waiting: str | None = None  # what the run waits for before its first step (None once it trains)
        self.sampler: str | None = None  # what difficulty sampling passed over (None: the cursor draws)
        self._eta: tuple[float, float] | None = None  # (ETA in seconds, perf_counter when it was computed)
        self._next_plain = 0.0
        self._printed_step = -1
        self._phase = ""  # the start-up stage shown last (plain lines: one at each new stage)
        self._stage = ""  # the start-up stage seen last, and since when (seconds since the start)
        self._stage_since = 0.0
        self._next_waiting = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def eta(self) -> float | None:
        """The ETA of the newest row, counted down since."""
        if self._eta is None:
            return None
        seconds, at = self._eta
        return max(0.0, seconds - (time.perf_counter() - at))

    def header(self) -> None:
        self.console.print(f"run [bold]{self.cfg.run.name}[/] in {self.cfg.run.dir}")
        lc = self.cfg.learner
        kl = f"KL penalty beta={lc.beta}" if lc.beta > 0 else "KL penalty off (beta = 0)"
        self.console.print(
            f"  {self.cfg.run.steps} steps of {lc.batch_groups} groups x {self.cfg.sampling.group_size}, "
            f"loss {lc.loss_type}, lr {lc.lr:g}, {kl}"
        )

    def say(self, line: str) -> None:
        """A line of its own (above the live view while it runs)."""
        self.console.print(line, highlight=False, soft_wrap=True, markup=False)

    def endpoints(self, endpoints: list[dict[str, Any]]) -> None:
        for e in endpoints:  # a SGLang server an actor launched is listed with its URL, under the actor's name
            label, url = (f"{e['name']} sglang", e["url"]) if e["role"] == "sglang" else (e["name"], e["metrics_url"])
            self.console.print(f"  {label:<10} pid {e['pid']:<8} {url}", soft_wrap=True)

    def __enter__(self) -> Progress:
        if self.live_enabled:
            self._live = Live(self._table(), console=self.console, refresh_per_second=4, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None

    def starting(self, startup: Startup) -> None:
        """Before the first step: show what the run waits for. Plain lines at each new stage, and every
        ``_PLAIN_EVERY_S`` while a stage's counts change."""
        phase, line = waiting_for(startup)
        if phase != self._stage:
            self._stage, self._stage_since = phase, self.elapsed()
        line = f"{line}, since {clock(self._stage_since)}"
        changed = line != self.waiting
        self.waiting = line
        if self._live is not None:
            self._live.update(self._table())
        elif phase != self._phase or (changed and time.perf_counter() >= self._next_waiting):
            self._phase = phase
            self._next_waiting = time.perf_counter() + _PLAIN_EVERY_S
            self.say(f"[{clock(self.elapsed())}] {line}")

    def update(self, rows: list[dict[str, Any]]) -> None:
        self.rows.extend(rows)
        for row in rows:
            if "eval/accuracy" in row:
                self.accuracy = row["eval/accuracy"]
            if "reward" in row:
                self.last = row
                self.waiting = None
        if rows and (eta := eta_s(self.rows, self.cfg.run.steps)) is not None:
            self._eta = (eta, time.perf_counter())
        if self._live is not None:
            self._live.update(self._table())  # every call: the elapsed time and the ETA count on between steps
        elif rows and self.last and time.perf_counter() >= self._next_plain:
            self._next_plain = time.perf_counter() + _PLAIN_EVERY_S
            self._plain_step()

    def sampled(self, choices: dict[str, int]) -> None:
        """Difficulty sampling's choices so far (prompts:choices), shown under the table and after each step line."""
        self.sampler = passed_over(choices)

    def finish(self) -> None:
        """Plain lines end with the last step, printed or not by the every-few-seconds rule."""
        if self._live is None and self.last and self.last["step"] != self._printed_step:
            self._plain_step()

    def _plain_step(self) -> None:
        self._printed_step = self.last["step"]
        line = step_line(self.last, self.cfg.run.steps, self.accuracy, self.elapsed(), self.eta())
        self.say(line + (f"  {self.sampler}" if self.sampler else ""))

    def _table(self) -> Table:
        r = self.last
        caption = f"elapsed {clock(self.elapsed())}"
        if self.waiting:
            caption += f"  {self.waiting}"
        elif r:
            caption += f"  eta {clock(self.eta())}"
        if self.sampler:
            caption += f"\n{self.sampler}"
        t = Table(title=f"grpo run {self.cfg.run.name}", caption=caption, show_header=True)
        for col in ("step", "reward", "accuracy", "zero-std", "staleness", "groups/s", "clip", "step s"):
            t.add_column(col, justify="right")
        if r:
            t.add_row(
                f"{r['step']}/{self.cfg.run.steps}",
                f"{r['reward']:.3f}",
                fmt(self.accuracy, ".2f"),
                f"{r['frac_reward_zero_std']:.2f}",
                f"{r['staleness/mean']:.2f}",
                f"{r['groups_per_s']:.1f}",
                f"{r['clip_ratio/region_mean']:.3f}",
                f"{r['time/step_s']:.2f}",
            )
        else:
            t.add_row("-", *[""] * 7)
        return t

    def summary(self, s: dict[str, Any]) -> None:
        t = Table(title="summary", show_header=False)
        t.add_column("what")
        t.add_column("value", justify="right")
        t.add_row("steps", str(s["steps"]))
        t.add_row("wall time", f"{s['wall_s']:.1f} s")
        t.add_row("reward, first 10 steps", fmt(s["reward_first10"]))
        t.add_row("reward, last 10 steps", fmt(s["reward_last10"]))
        t.add_row("eval accuracy, step 0", fmt(s["eval_accuracy_first"], ".2f"))
        t.add_row("eval accuracy, final", fmt(s["eval_accuracy_final"], ".2f"))
        t.add_row("zero-std fraction, last 10", fmt(s["frac_reward_zero_std_last10"], ".2f"))
        t.add_row("staleness mean / max", f"{fmt(s['staleness_mean'], '.2f')} / {fmt(s['staleness_max'], '.0f')}")
        t.add_row("groups/s", fmt(s["groups_per_s"], ".1f"))
        filtered = sum(s["groups_filtered"].values())
        t.add_row("groups filtered by actors", str(filtered))
        if s["prompt_choices"]:
            t.add_row("difficulty sampling", passed_over(s["prompt_choices"]))
        self.console.print(t)
        self.console.print(f"accounting: {s['equation']}", highlight=False, soft_wrap=True)
        if s.get("prompt_equation"):
            self.console.print(f"            {s['prompt_equation']}", highlight=False, soft_wrap=True)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarise(
    rows: list[dict[str, Any]], balance: Any, wall_s: float, choices: dict[str, int], prompts: Any = None
) -> dict[str, Any]:
    steps = [r for r in rows if r.get("step", 0) > 0 and "reward" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    rewards = [r["reward"] for r in steps]
    return {
        "steps": len(steps),
        "wall_s": wall_s,
        "reward_first10": _mean(rewards[:10]),
        "reward_last10": _mean(rewards[-10:]),
        "eval_accuracy_first": evals[0]["eval/accuracy"] if evals else None,
        "eval_accuracy_final": evals[-1]["eval/accuracy"] if evals else None,
        "frac_reward_zero_std_last10": _mean([r["frac_reward_zero_std"] for r in steps[-10:]]),
        "staleness_mean": _mean([r["staleness/mean"] for r in steps]),
        "staleness_max": max((r["staleness/max"] for r in steps), default=None),
        "groups_per_s": steps[-1]["groups_per_s"] if steps else None,
        "groups_produced": balance.produced,
        "groups_trained": balance.trained,
        "groups_dropped": balance.dropped,
        "groups_dead": balance.dead,
        "groups_in_stream": balance.in_stream,
        "groups_pending": balance.pending,
        "groups_unread": balance.unread,
        "groups_filtered": balance.filtered,
        "prompt_choices": choices,  # difficulty sampling's positions taken / passed over, by pool ({}: the cursor)
        "unexplained": balance.unexplained,
        "equation": balance.equation(),
        # Every prompt position drawn, accounted for (common.schemas.prompts); None when not read
        "prompt_equation": prompts.equation() if prompts is not None else None,
        "prompts_unexplained": prompts.unexplained if prompts is not None else 0,
    }
