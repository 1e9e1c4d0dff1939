"""Which training problems an actor's next round draws (``actor.prompt_sampling``), and what it records of them.

``cursor``: the next ``k`` positions of the shared cursor (common.tasks: every problem once a pass, no two actors
alike). ``difficulty``: the same positions, each problem taken or passed over by what its recent groups taught
(actor.difficulty, the pure decisions), positions claimed until the round is whole; after grading, the round's
outcomes are added to the run's record (common.transport.difficulty), which every actor reads.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import redis

from actor.difficulty import Draw, choose, outcome, position_cap
from common.config import Config
from common.metrics import ActorMetrics
from common.tasks import Problem, Task
from common.transport import ActorTransport

log = logging.getLogger(__name__)


class PromptSource:
    def __init__(self, cfg: Config, task: Task, transport: ActorTransport, metrics: ActorMetrics):
        self.by_difficulty = cfg.actor.prompt_sampling == "difficulty"
        self.floor = cfg.actor.difficulty_floor
        self.window = cfg.actor.difficulty_window
        self.seed = cfg.run.seed
        self.task = task
        self.transport = transport
        self.metrics = metrics
        self._counts: dict[str, int] = {}  # choices made since the record was last written
        self._record_broken = False  # the record's key holds something else: draw in the cursor's order

    def draw(self, k: int) -> list[Problem]:
        if not self.by_difficulty:
            return [self.task.at(p) for p in self.transport.next_prompts(k)]
        taken: list[Problem] = []
        passed: list[Problem] = []
        claimed, cap = 0, position_cap(k, self.floor)
        in_round: set[str] | None = set() if k <= len(self.task.train) else None  # no problem twice in a round
        while len(taken) < k and claimed < cap:
            positions = self.transport.next_prompts(min(k - len(taken), cap - claimed))  # never more than it needs
            claimed += len(positions)
            problems = [self.task.at(p) for p in positions]
            ids = [p.id for p in problems]
            draw = choose(positions, self._histories(problems), self.seed, self.floor, ids, in_round)
            taken += [problems[i] for i in draw.taken]
            passed += [problems[i] for i in draw.passed]
            self._count(draw)
        if len(taken) < k:  # the cap: a whole round of the problems passed over first (see position_cap)
            log.info("difficulty sampling passed over %d positions for a round of %d: taking %d of them", claimed, k,
                     k - len(taken))  # fmt: skip
            for p in passed:
                if len(taken) < k and (in_round is None or p.id not in in_round):
                    taken.append(p)
                    if in_round is not None:
                        in_round.add(p.id)
        return taken

    def record(self, problems: Sequence[Problem], rewards: Sequence[Sequence[float]]) -> None:
        """Add a graded round's outcomes to the run's record, with the choices counted since the last round."""
        if not self.by_difficulty or self._record_broken:
            return
        outcomes = [(p.id, outcome(r)) for p, r in zip(problems, rewards, strict=True)]
        try:
            self.transport.record_outcomes(outcomes, self.window, self._counts)
        except redis.ResponseError as e:
            self._broken(e)
        self._counts = {}

    def _histories(self, problems: Sequence[Problem]) -> list[str]:
        if self._record_broken:
            return [""] * len(problems)
        try:
            return self.transport.histories([p.id for p in problems], self.window)
        except redis.ResponseError as e:
            self._broken(e)
            return [""] * len(problems)

    def _broken(self, e: redis.ResponseError) -> None:
        self._record_broken = True
        log.warning(
            "the run's problem record (%s) cannot be used (%s): this actor draws in the cursor's order from now on; "
            "delete the key to let difficulty sampling rebuild it",
            self.transport.keys.prompts_record,
            e,
        )

    def _count(self, draw: Draw) -> None:
        for kind, pools, metric in (("taken", draw.pools_taken, self.metrics.prompts_taken),
                                    ("passed", draw.pools_passed, self.metrics.prompts_passed)):  # fmt: skip
            for name, n in pools.items():
                metric.labels(name).inc(n)
                self._counts[f"{kind}:{name}"] = self._counts.get(f"{kind}:{name}", 0) + n
