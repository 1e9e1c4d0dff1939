"""The seed's warnings about a run going wrong, raised from the step metrics (pure; the learner logs and exports them).

- ``clip_ratio``: the clip is active for a large fraction of tokens step after step — updates keep hitting the trust
  region's edge, most often because the learning rate is too large.
- ``zero_std``: most sampled groups have equal rewards — the prompts are too easy or too hard for the model, and
  little of what is sampled carries a signal.

An alarm is raised when its condition has held for ``window`` consecutive steps, logged once, and re-armed when the
condition clears.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MESSAGES = {
    "clip_ratio": "clip_ratio/region_mean above {t} for {w} steps: the learning rate is likely too large",
    "zero_std": "frac_reward_zero_std above {t} for {w} steps: the prompts are too easy or too hard for the model",
}


@dataclass
class Alarms:
    window: int
    clip_ratio: float
    zero_std: float
    streak: dict[str, int] = field(default_factory=lambda: {k: 0 for k in MESSAGES})
    active: dict[str, bool] = field(default_factory=lambda: {k: False for k in MESSAGES})

    def update(self, row: dict[str, float]) -> list[str]:
        """Feed one step's metrics; returns the messages of alarms raised by this step."""
        over = {
            "clip_ratio": row.get("clip_ratio/region_mean", 0.0) > self.clip_ratio,
            "zero_std": row.get("frac_reward_zero_std", 0.0) > self.zero_std,
        }
        thresholds = {"clip_ratio": self.clip_ratio, "zero_std": self.zero_std}
        raised = []
        for kind, is_over in over.items():
            self.streak[kind] = self.streak[kind] + 1 if is_over else 0
            if not is_over:
                self.active[kind] = False
            elif self.streak[kind] >= self.window and not self.active[kind]:
                self.active[kind] = True
                raised.append(MESSAGES[kind].format(t=thresholds[kind], w=self.window))
        return raised
