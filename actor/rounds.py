"""Rounds in flight: an actor keeps up to ``k`` rounds generating at once on an engine that batches concurrent
requests (a SGLang server's continuous batching), and grades and sends the oldest while the others generate.

Each round holds its own reservation of room (:meth:`common.transport.ActorTransport.reserve_round`), under a holder
name of its slot: the actor's id for slot 0 (the only one of a one-round actor, as before), ``<id>/<slot>`` for the
others. A round's policy version is the one its reply was generated with: a SGLang server reports it, and it updates
its weights only between requests (an update waits for the requests in flight, SGLang 0.5.23's model update lock),
so one reply is one version; where a server reports none, the version held when the round was sent.

With ``k`` = 1 (the local engine, the synchronous baseline) a round is generated in the caller's thread, exactly as
a round always was, unless in-flight updates load versions while the caller waits for it (:func:`sampled_aside`).
Pure bookkeeping and a thread pool; the loop (:mod:`actor.loop`) does the Redis side.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from actor.engines.base import Engine
from actor.engines.sglang.unannounced import UnannouncedWeights
from common.config import Config
from common.rollout import Sample
from common.tasks import Problem
from env.episodes import Episodes


@dataclass
class Round:
    holder: str  # whose reservation: the actor's id, or <id>/<slot>
    problems: list[Problem]
    started: float = field(default_factory=time.perf_counter)
    generated: float = 0.0  # when its samples came back (a round in flight may wait to be taken after that)
    version: int = 0  # the policy version it was (or is being) generated with
    future: Future[tuple[list[list[Sample]], int | None]] | None = None
    samples: list[list[Sample]] = field(default_factory=list)
    positions: list[int] | None = None  # each problem's prompt position (common.transport.prompts)
    unsampled: dict[str, int] = field(default_factory=dict)  # counts of the positions drawn and not sampled
    refused: str = ""  # why its samples cannot be sent (actor.engines.sglang.unannounced), or ''


def rounds_in_flight(cfg: Config, engine: Engine) -> int:
    """SGLang batches concurrent requests, so its actors keep ``sglang.rounds_in_flight`` rounds going (the sim engine
    ``actor.sim_rounds_in_flight``); an engine in this process generates one round at a time, and the synchronous
    baseline samples one round per version."""
    caps = engine.capabilities
    return caps.rounds_in_flight if caps.concurrent_requests and not cfg.actor.synchronous else 1


def sampled_aside(cfg: Config, engine: Engine) -> bool:
    """With in-flight updates the actor loads versions into an engine that batches concurrent requests (SGLang) while
    it waits for a round, so even one round in flight is generated in another thread."""
    return cfg.actor.weight_updates == "in_flight" and engine.capabilities.concurrent_requests


class InFlight:
    def __init__(self, actor_id: str, engine: Engine, k: int, aside: bool = False, episodes: Episodes | None = None):
        self.id = actor_id
        self.engine = engine
        self.k = k
        self.episodes = episodes  # env.name tool or yours: a round's samples are whole episodes (env.episodes)
        self.pending: deque[Round] = deque()
        self._pool = ThreadPoolExecutor(k, thread_name_prefix="generate") if k > 1 or aside else None

    def holders(self) -> list[str]:
        """Every holder name this actor may reserve under (renewed with each heartbeat, released on the way out)."""
        return [self.holder(slot) for slot in range(self.k)]

    def holder(self, slot: int) -> str:
        return self.id if slot == 0 else f"{self.id}/{slot}"

    def free_holder(self) -> str | None:
        """The holder name of a free slot, or None when ``k`` rounds are in flight."""
        busy = {r.holder for r in self.pending}
        return next((h for h in self.holders() if h not in busy), None)

    def start(self, holder: str, problems: list[Problem], prompts: list[list[int]], group: int) -> Round:
        rnd = Round(holder, problems, version=self.engine.version)
        if self._pool is None:  # one round at a time: generated here and now
            try:
                rnd.samples = self._generate(prompts, group, problems)[0]
            except UnannouncedWeights as e:
                rnd.refused = str(e)
            rnd.version = self.engine.version  # a SGLang engine may learn from its reply what its server holds
            rnd.generated = time.perf_counter()
        else:
            rnd.future = self._pool.submit(self._generate, prompts, group, problems)
            rnd.future.add_done_callback(lambda _: setattr(rnd, "generated", time.perf_counter()))
        self.pending.append(rnd)
        return rnd

    def _generate(
        self, prompts: list[list[int]], group: int, problems: list[Problem]
    ) -> tuple[list[list[Sample]], int | None]:
        if self.episodes is None:
            return self._turn(prompts, group, False)
        return self.episodes.run(self._turn, prompts, group, version_now=lambda: self.engine.version, problems=problems)

    def _turn(self, prompts: Sequence[Sequence[int]], n: int, greedy: bool) -> tuple[list[list[Sample]], int | None]:
        """One generation: the round's answers, or one turn of its episodes (the same engine call)."""
        return self.engine.generate_versioned(prompts, n, greedy=greedy)

    def settle(self, waiting: Callable[[], None]) -> None:
        """Wait until every round in flight is generated (they stay pending, to be taken in order): before a weights
        update, so that no request of this actor reaches the server between the update and the flush of its prefix
        cache, which a request still running can put off (see actor.engines.sglang.engine)."""
        for rnd in self.pending:
            _await(rnd, waiting)

    def finish_oldest(self, waiting: Callable[[], None]) -> Round:
        """The oldest round, once generated (``waiting()`` is called every 0.2 s meanwhile: heartbeats); an engine's
        error is raised here, for the loop to handle as before."""
        rnd = self.pending[0]
        if rnd.future is not None:
            _await(rnd, waiting)
            try:
                groups, version = rnd.future.result()
            except UnannouncedWeights as e:  # generated (in part) by weights never announced: not to be sent
                groups, version, rnd.refused = [], None, str(e)
            rnd.samples = groups
            rnd.version = version if version is not None else rnd.version
        return self.pending.popleft()

    def close(self) -> None:
        """Stop taking rounds: those not started are cancelled, those generating are waited for, none is kept."""
        self.pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _await(rnd: Round, waiting: Callable[[], None]) -> None:
    """Until ``rnd`` is generated, calling ``waiting()`` every 0.2 s (heartbeats)."""
    while rnd.future is not None and not wait([rnd.future], timeout=0.2).done:
        waiting()
