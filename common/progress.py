"""What ``grpo run`` shows: a live view while it runs (or plain lines when stdout is not a terminal), then a summary."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from common.config import Config

_PLAIN_EVERY_S = 5.0


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


class Progress:
    def __init__(self, cfg: Config, live: bool):
        self.cfg = cfg
        self.console = Console()
        self.live_enabled = live
        self._live: Live | None = None
        self.last: dict[str, Any] = {}
        self.accuracy: float | None = None
        self._next_plain = 0.0

    def endpoints(self, endpoints: list[dict[str, Any]]) -> None:
        self.console.print(f"run [bold]{self.cfg.run.name}[/] in {self.cfg.run.dir}")
        for e in endpoints:  # a SGLang server an actor launched is listed with its URL, under the actor's name
            label, url = (f"{e['name']} sglang", e["url"]) if e["role"] == "sglang" else (e["name"], e["metrics_url"])
            self.console.print(f"  {label:<10} pid {e['pid']:<8} {url}", soft_wrap=True)
        lc = self.cfg.learner
        kl = f"KL penalty beta={lc.beta}" if lc.beta > 0 else "KL penalty off (beta = 0)"
        self.console.print(
            f"  {self.cfg.run.steps} steps of {lc.batch_groups} groups x {self.cfg.actor.group_size}, "
            f"loss {lc.loss_type}, lr {lc.lr:g}, {kl}"
        )

    def __enter__(self) -> Progress:
        if self.live_enabled:
            self._live = Live(self._table(), console=self.console, refresh_per_second=4, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None

    def update(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            if "eval/accuracy" in row:
                self.accuracy = row["eval/accuracy"]
            if "reward" in row:
                self.last = row
        if not rows:
            return
        if self._live is not None:
            self._live.update(self._table())
        elif self.last and time.monotonic() >= self._next_plain:
            self._next_plain = time.monotonic() + _PLAIN_EVERY_S
            r = self.last
            self.console.print(
                f"step {r['step']:>4}/{self.cfg.run.steps}  reward {r['reward']:.3f}  "
                f"accuracy {_fmt(self.accuracy, '.2f')}  zero-std {r['frac_reward_zero_std']:.2f}  "
                f"staleness {r['staleness/mean']:.2f}  {r['groups_per_s']:.1f} groups/s",
                highlight=False,
                soft_wrap=True,
            )

    def _table(self) -> Table:
        r = self.last
        t = Table(title=f"grpo run {self.cfg.run.name}", show_header=True)
        for col in ("step", "reward", "accuracy", "zero-std", "staleness", "groups/s", "clip", "step s"):
            t.add_column(col, justify="right")
        if r:
            t.add_row(
                f"{r['step']}/{self.cfg.run.steps}",
                f"{r['reward']:.3f}",
                _fmt(self.accuracy, ".2f"),
                f"{r['frac_reward_zero_std']:.2f}",
                f"{r['staleness/mean']:.2f}",
                f"{r['groups_per_s']:.1f}",
                f"{r['clip_ratio/region_mean']:.3f}",
                f"{r['time/step_s']:.2f}",
            )
        else:
            t.add_row("waiting for the first step", *[""] * 7)
        return t

    def summary(self, s: dict[str, Any]) -> None:
        t = Table(title="summary", show_header=False)
        t.add_column("what")
        t.add_column("value", justify="right")
        t.add_row("steps", str(s["steps"]))
        t.add_row("wall time", f"{s['wall_s']:.1f} s")
        t.add_row("reward, first 10 steps", _fmt(s["reward_first10"]))
        t.add_row("reward, last 10 steps", _fmt(s["reward_last10"]))
        t.add_row("eval accuracy, step 0", _fmt(s["eval_accuracy_first"], ".2f"))
        t.add_row("eval accuracy, final", _fmt(s["eval_accuracy_final"], ".2f"))
        t.add_row("zero-std fraction, last 10", _fmt(s["frac_reward_zero_std_last10"], ".2f"))
        t.add_row("staleness mean / max", f"{_fmt(s['staleness_mean'], '.2f')} / {_fmt(s['staleness_max'], '.0f')}")
        t.add_row("groups/s", _fmt(s["groups_per_s"], ".1f"))
        filtered = sum(s["groups_filtered"].values())
        t.add_row("groups filtered by actors", str(filtered))
        self.console.print(t)
        self.console.print(f"accounting: {s['equation']}", highlight=False, soft_wrap=True)
