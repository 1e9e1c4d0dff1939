"""Where the learner stands: the figures a checkpoint saves, which every part of the learner reads or moves on."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from common.metrics import LearnerMetrics
from common.schemas import DropReason
from learner.checkpoint import Resumable
from learner.lineage import Lineage


@dataclass
class Progress:
    step: int = 0  # learner steps taken
    version: int = 0  # the policy version of the current weights: the step, unless a resume skipped versions
    groups_consumed: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    dead: int = 0
    run_id: str = ""  # the run's identity in Redis (see learner.identity)
    # The epochs of this policy's lineage: staleness is measured along it.
    lineage: Lineage = field(default_factory=Lineage)
    # Trained since the last checkpoint, not yet acknowledged: the checkpoint that covers them acks them.
    window_ids: list[str] = field(default_factory=list)
    window_groups: list[str] = field(default_factory=list)
    window_positions: list[int] = field(default_factory=list)  # their prompt positions (-1: a group without one)
    checkpointed_step: int = -1

    def counters(self) -> dict[str, Any]:
        return {"groups_consumed": self.groups_consumed, "dropped": dict(self.dropped), "dead": self.dead}

    def count_dropped(self, reason: DropReason, n: int, metrics: LearnerMetrics) -> None:
        self.dropped[reason] += n
        metrics.groups_dropped.labels(reason).inc(n)

    def count_dead(self, n: int, metrics: LearnerMetrics) -> None:
        self.dead += n
        metrics.groups_dead.inc(n)

    def resumable(self) -> Resumable:
        """What a checkpoint keeps besides the model and the optimizer."""
        return Resumable(self.step, self.version, self.counters(), self.window_ids, self.window_groups,
                         self.run_id, self.lineage.to_json(), covers_positions=self.window_positions)  # fmt: skip

    def restore(self, r: Resumable) -> None:
        self.step, self.version, self.checkpointed_step = r.step, r.version, r.step
        self.groups_consumed = r.counters.get("groups_consumed", 0)
        self.dropped = Counter(r.counters.get("dropped", {}))
        self.dead = r.counters.get("dead", 0)
        self.run_id = r.run_id
        # A checkpoint of an earlier build has no lineage: only its own step and version are known to match.
        self.lineage = Lineage.from_json(r.epochs or [[0, r.step, r.version]])
