"""Which training problems an actor's next round draws (``actor.prompt_sampling``), and what it records of them.

``cursor``: the next ``k`` positions of the shared cursor (common.tasks: every problem once a pass, no two actors
alike). ``difficulty``: the same positions, each problem taken or passed over by what its recent groups taught
(actor.difficulty, the pure decisions), positions claimed until the round is whole; after grading, the round's
outcomes are added to the run's record (common.transport.difficulty), which every actor reads.

Either way the positions are drawn under the round holder's claim (common.transport.prompts): positions another
actor gave back come first, and the round's write settles the claim with the fate of every position it drew (its
problems, and those passed over), so that the prompts' accounting balances.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import redis

from actor.difficulty import Draw, choose, outcome, position_cap
from common.config import Config
from common.metrics import ActorMetrics
from common.schemas import prompt_counter
from common.tasks import Problem, Task
from common.transport import ActorTransport

log = logging.getLogger(__name__)


@dataclass
class Drawn:
    """A round's problems and the cursor position each was drawn at, and the positions drawn and never sampled:
    passed over by difficulty sampling, or too long for the model (:meth:`actor.loop.Actor.next_problems`)."""

    problems: list[Problem] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    passed: list[int] = field(default_factory=list)
    too_long: list[int] = field(default_factory=list)

    def unsampled(self) -> dict[str, int]:
        """The round's counts of the positions it skipped (``prompts_skipped:<reason>``)."""
        counts = {prompt_counter("skipped", "difficulty"): len(self.passed),
                  prompt_counter("skipped", "too_long"): len(self.too_long)}  # fmt: skip
        return {k: n for k, n in counts.items() if n}


class PromptSource:
    def __init__(self, cfg: Config, task: Task, transport: ActorTransport, metrics: ActorMetrics):
        self.by_difficulty = cfg.actor.prompt_sampling == "difficulty"
        self.floor = cfg.actor.difficulty_floor
        self.window = cfg.actor.difficulty_window
        self.seed = cfg.run.seed
        self.task = task
        self.transport = transport
        self.lease_s = cfg.run.heartbeat_ttl_s  # a claim lasts as the round's reservation does, renewed with it
        self.metrics = metrics
        self._counts: dict[str, int] = {}  # choices made since the record was last written
        self._record_broken = False  # the record's key holds something else: draw in the cursor's order

    def draw(self, k: int, holder: str) -> Drawn:
        """The problems of ``holder``'s next round, drawn under its claim."""
        if not self.by_difficulty:
            positions = self.transport.next_prompts(k, holder, self.lease_s)
            return Drawn([self.task.at(p) for p in positions], list(positions))
        out = Drawn()
        passed: list[tuple[int, Problem]] = []
        claimed, cap = 0, position_cap(k, self.floor)
        in_round: set[str] | None = set() if k <= len(self.task.train) else None  # no problem twice in a round
        while len(out.problems) < k and claimed < cap:
            want = min(k - len(out.problems), cap - claimed)  # never more than it needs
            positions = self.transport.next_prompts(want, holder, self.lease_s, new_round=claimed == 0)
            claimed += len(positions)
            problems = [self.task.at(p) for p in positions]
            ids = [p.id for p in problems]
            draw = choose(positions, self._histories(problems), self.seed, self.floor, ids, in_round)
            out.problems += [problems[i] for i in draw.taken]
            out.positions += [positions[i] for i in draw.taken]
            passed += [(positions[i], problems[i]) for i in draw.passed]
            self._count(draw)
        if len(out.problems) < k:  # the cap: a whole round of the problems passed over first (see position_cap)
            log.info("difficulty sampling passed over %d positions for a round of %d: taking %d of them", claimed, k,
                     k - len(out.problems))  # fmt: skip
            for position, p in list(passed):
                if len(out.problems) < k and (in_round is None or p.id not in in_round):
                    out.problems.append(p)
                    out.positions.append(position)
                    passed.remove((position, p))
                    if in_round is not None:
                        in_round.add(p.id)
        out.passed = [position for position, _ in passed]
        return out

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


class PromptIds:
    """Each problem's prompt as the model's token ids (``task``'s template applied; a cache of recent prompts, not of
    a whole large dataset), and which prompts leave room for an answer within the model's positions (``limit``)."""

    def __init__(self, encode: Callable[[str], list[int]], limit: int | None, metrics: ActorMetrics):
        self.encode = encode
        self.limit = limit
        self.metrics = metrics
        self._ids: dict[str, list[int]] = {}
        self._warned_long = False

    def __call__(self, problem: Problem) -> list[int]:
        ids = self._ids.get(problem.id)
        if ids is None:
            if len(self._ids) >= 10_000:
                self._ids.clear()
            ids = self._ids[problem.id] = self.encode(problem.prompt)
        return ids

    def fitting(self, drawn: Drawn) -> Drawn:
        """``drawn`` without the problems too long for the model (their positions in ``too_long``: skipped,
        counted as grpo_actor_prompts_skipped_total, warned once)."""
        if self.limit is None:
            return drawn
        fits = [len(self(p)) <= self.limit for p in drawn.problems]
        if not all(fits):
            self.metrics.prompts_skipped.inc(fits.count(False))
            if not self._warned_long:
                self._warned_long = True
                log.warning("skipping training prompts longer than %d tokens (one has %d): raise the model's positions "
                            "or lower sampling.max_new_tokens, or shorten the template (counted as "
                            "grpo_actor_prompts_skipped_total; warned once)", self.limit,
                            max(len(self(p)) for p in drawn.problems))  # fmt: skip
        return Drawn(
            [p for p, ok in zip(drawn.problems, fits, strict=True) if ok],
            [x for x, ok in zip(drawn.positions, fits, strict=True) if ok],
            drawn.passed,
            [x for x, ok in zip(drawn.positions, fits, strict=True) if not ok],
        )
