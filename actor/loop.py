"""The actor: ``reload weights → wait for room → take prompts → sample → grade → filter and send → heartbeat``.

Each step is one short method; the loop ends when the learner marks the run done, on SIGTERM/SIGINT (after the
current round: a round's groups are sent in one transaction, never half, waiting up to ``actor.stop_send_timeout_s``
for room), or on an error that is not retried. The process around it (Redis, metrics, grader, engine) is
:mod:`actor.process`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from actor.engines.base import Engine, EngineError, NcclEngine, load_if_due
from actor.identity import Heartbeat, take_actor_id
from actor.outgoing import FILTERED_ZERO_STD, Outgoing, RoundEncoder
from actor.prompts import Drawn, PromptIds, PromptSource
from actor.rounds import InFlight, Round, rounds_in_flight, sampled_aside
from actor.weights import WeightsSource
from actor.weights.disk import DiskWeights
from actor.weights.mid_round import in_flight_updates
from actor.weights.nccl import Receiver
from common.config import Config
from common.liveness import Liveness
from common.metrics import ActorMetrics
from common.model.limits import message_byte_limit
from common.rollout import Sample, SampleGrader
from common.schemas import FORWARDED, WeightsAnnouncement
from common.tasks import Problem, PromptEncoder, make_task
from common.transport import ActorTransport, Admission, ClaimLost, Superseded, round_fits
from env.episodes import Episodes, episode_counts

log = logging.getLogger("actor")


class Actor:
    def __init__(
        self,
        cfg: Config,
        actor_id: str,
        transport: ActorTransport,
        engine: Engine,
        grader: SampleGrader,
        metrics: ActorMetrics,
        prompt_limit: int | None = None,
        episodes: Episodes | None = None,
        liveness: Liveness | None = None,
    ):
        self.cfg = cfg
        # The loop's beats, for /healthz (common.liveness): the heartbeat thread's Redis beats go on while it hangs.
        self.liveness = liveness or Liveness(cfg.metrics.stall_after_s)
        self.id = actor_id
        self.transport = transport
        self.engine = engine
        self.grader = grader
        self.metrics = metrics
        self.task = make_task(cfg.task, cfg.run.seed)
        # Prompts longer than prompt_limit leave no room for an answer within the model's positions: skipped, counted.
        self.prompt_ids = PromptIds(PromptEncoder(engine.tokenizer, cfg.task), prompt_limit, metrics)
        self.prompts = PromptSource(cfg, self.task, transport, metrics)
        self.outgoing = RoundEncoder(cfg, actor_id, message_byte_limit(cfg))
        self.stop = threading.Event()
        lc = cfg.learner
        self.admission = Admission(cfg.actor.max_stream_groups, lc.batch_groups, lc.max_staleness, lc.publish_every - 1)
        self.max_message_bytes = self.outgoing.max_message_bytes
        self.groups_sent = 0
        self.rounds = 0
        self.version_sampled = engine.version  # the policy version of the round being graded and sent
        self.in_flight = InFlight(actor_id, engine, rounds_in_flight(cfg, engine), sampled_aside(cfg, engine), episodes)
        self._pubsub: Any = None
        self._set_up_weights()
        ttl = cfg.run.heartbeat_ttl_s
        self.heartbeat = Heartbeat(transport, actor_id, ttl, self._beat_info, self.in_flight.holders,
                                   lambda: self.receiver.register() if self.receiver is not None else None)  # fmt: skip
        self.superseded = False  # a newer process took this actor's id: it stops (common.transport.Superseded)

    def _set_up_weights(self) -> None:
        """Where versions come from (actor.weights): the shared volume; NCCL, with an engine that takes weights that
        way; and with in-flight updates, the shared volume's versions mid-round too."""
        cfg, engine = self.cfg, self.engine
        nccl = cfg.weights.transport == "nccl" and engine.capabilities.nccl_ranks > 0
        self.disk = DiskWeights(self.transport, engine, self.metrics, over_nccl=nccl)
        self.disk.before_load = self._before_load
        self.disk.drain = lambda: self._pubsub.get_message() if self._pubsub is not None else None
        self.updates = in_flight_updates(cfg, engine, self.disk.newer, self.disk.load,
                                         lambda: bool(self._pubsub.get_message()), self.disk.same_lineage)  # fmt: skip
        self.receiver: Receiver | None = None
        if nccl:
            self.receiver = Receiver(cfg, self.id, self.transport, cast(NcclEngine, engine), self.metrics, self.stop)
        self.sources: list[WeightsSource] = [*([self.receiver] if self.receiver else []), self.disk]

    # -- the loop -----------------------------------------------------------------------------------------------

    def run(self) -> str:
        """Returns why it stopped."""
        if not take_actor_id(self.transport, self.id, self.stop, self.liveness):
            return "asked to stop"
        self._pubsub = self.transport.subscribe_weights()
        self.heartbeat.start()
        try:
            while not self.stop.is_set():
                self.liveness.beat("between rounds", version=self.engine.version)
                self.heartbeat()
                if self.transport.is_done():
                    return "the learner finished the run"
                self.reload_weights()
                if self.engine.version < 0:  # a version arrived in part: sample nothing until a whole one is loaded
                    self._wait(lambda: self.engine.version < 0, doing="waiting for a whole version")
                    continue
                if (rnd := self.next_round()) is not None:
                    self.send(rnd, self.grade(rnd.problems, rnd.samples))
                    if self.cfg.actor.synchronous:
                        self.wait_for_new_version()
            self._send_rounds_in_flight()
            return "asked to stop"
        except Superseded:
            self.superseded = True  # what is registered under the id from now on is the newer process's
            raise
        finally:
            self.heartbeat.stop()
            self.in_flight.close()
            self._release_round()
            self._pubsub.close()
            if self.receiver is not None and not self.superseded:
                self.receiver.unregister()

    # -- steps --------------------------------------------------------------------------------------------------

    def reload_weights(self) -> None:
        """Between rounds, the version each source has (over NCCL, then from disk), where it differs from ours."""
        for source in self.sources:
            source.poll(self.heartbeat)

    def _before_load(self, ann: WeightsAnnouncement) -> None:
        """A version from disk, between rounds: in flight, an engine's other rounds are paused for it (see
        actor.engines.sglang.engine), unless a restarted learner published it; else they finish first."""
        self.liveness.beat(f"loading weights v{ann.version}")
        if self.updates is None or not self.disk.same_lineage(ann):
            self.in_flight.settle(self.heartbeat)  # no request of ours between the update and its cache flush

    def wait_for_new_version(self) -> None:
        """The synchronous baseline (actor.synchronous): sample again only with weights newer than this round's
        (the wait counts as backpressure)."""

        def behind() -> bool:
            ann = self.disk.announced()
            return ann is None or ann.version <= self.version_sampled

        # An announcement that arrived while this round was sampled (the previous version's) must not end the wait.
        self._wait(behind, until_clear=True, doing="waiting for a new version")

    def next_round(self) -> Round | None:
        """Start rounds while a slot is free and there is room, then the oldest round once generated; None when the
        loop should re-check its exit conditions first (no room, or no prompt of the round fit)."""
        while (holder := self.in_flight.free_holder()) is not None:
            if not (self.wait_for_room(holder) if not self.in_flight.pending else self._reserve_round(holder)):
                break
            try:
                drawn = self.next_problems(holder)
            except ClaimLost as e:  # drawing more for the round (difficulty sampling) after its claim went
                self._claim_lost(None, holder, e)
                break
            if not drawn.problems:  # every prompt of the round was too long: the round ends, its positions skipped
                self._produce(Outgoing(counters=Counter(drawn.unsampled())), holder)
                self.stop.wait(0.1)
                break
            problems = drawn.problems
            prompts = [self.prompt_ids(p) for p in problems]
            self.liveness.beat("sampling a round", version=self.engine.version)
            rnd = self.in_flight.start(holder, problems, prompts, self.cfg.sampling.group_size)
            rnd.positions, rnd.unsampled = drawn.positions, drawn.unsampled()
        if not self.in_flight.pending:
            return None
        rnd = self.sampled(self.in_flight.finish_oldest(self._while_sampling))
        return None if self._refused(rnd) else rnd

    def _while_sampling(self) -> None:
        """Called every 0.2 s while the actor waits for a round: heartbeats, and with in-flight updates on an engine
        that samples in other threads (SGLang's rounds), a new version loaded as soon as it is announced."""
        self.heartbeat()
        if self.updates is not None and self.engine.updates is None:
            load_if_due(self.updates)

    def _send_rounds_in_flight(self) -> None:
        """Asked to stop: the rounds already generating are finished and sent (each within
        ``actor.stop_send_timeout_s`` of room), as the one round in hand always was."""
        while self.in_flight.pending:
            rnd = self.sampled(self.in_flight.finish_oldest(self.heartbeat))
            if not self._refused(rnd):
                self.send(rnd, self.grade(rnd.problems, rnd.samples))

    def wait_for_room(self, holder: str) -> bool:
        """Backpressure, before sampling: reserve room for a whole round among the groups the learner can still
        train in time (:meth:`ActorTransport.reserve_round`: within ``actor.max_stream_groups`` unread, and no more
        groups ahead of the learner, rounds other actors are sampling included, than it trains before they pass
        ``learner.max_staleness``). Without room, wait (a weights announcement wakes us early) rather than sample a
        round that would age waiting and be dropped as stale. Returns False when the loop should re-check its exit
        conditions (and load new weights) first."""
        if self._reserve_round(holder):
            return True
        self._wait(lambda: not self._reserve_round(holder))
        return False

    def _reserve_round(self, holder: str) -> bool:
        version, need = self.engine.version, self.cfg.actor.prompts_per_round
        return self.transport.reserve_round(holder, need, version, self.admission, self.cfg.run.heartbeat_ttl_s)

    def _release_round(self) -> None:
        """Best effort, on the way out (Redis may be what failed): a reservation left behind ends with its lease. A
        superseded process gives back its own claims and leaves the reservations, now the newer process's."""
        try:
            for holder in self.in_flight.holders():
                self.transport.release_round(holder, reservation=not self.superseded)
        except Exception as e:
            log.debug("releasing the rounds' reservations: %s", e)

    def _wait(
        self,
        blocked: Callable[[], bool],
        *,
        until_clear: bool = False,
        deadline: float | None = None,
        doing: str = "waiting for room",
    ) -> None:
        """Wait while ``blocked()``, counted as backpressure; a weights announcement ends the wait early so that the
        caller re-checks its conditions, unless ``until_clear``. The run ending or a stop request always ends it,
        except with a ``deadline`` (a ``time.monotonic()`` value: a stopping actor waiting to send its last round),
        which ends it instead. It beats as it waits (``doing``): a learner that is slow or stopped keeps an actor
        waiting, alive, for as long as it takes."""
        t0 = time.perf_counter()
        while (deadline is not None or not self.stop.is_set()) and blocked():
            self.liveness.beat(doing)
            t0 = self._count_wait(t0)
            if deadline is not None and time.monotonic() >= deadline:
                break
            self.heartbeat()  # waiting is working: the key must not expire
            if why := self.engine.failed():  # a launched server that died meanwhile
                raise EngineError(why)
            if self.receiver is not None and self.receiver.poll(self.heartbeat):
                break  # new weights: the caller re-checks its conditions
            woken = self._pubsub.get_message(timeout=0.2) is not None
            if (woken and not until_clear) or self.transport.is_done():
                break
        self._count_wait(t0)

    def _count_wait(self, since: float) -> float:
        """Count the wait as it goes, not once it ends: a learner that stopped reading keeps actors waiting for as
        long as it is stuck, and ``rate()`` of the counter must show that while it lasts (the stream-full alert)."""
        now = time.perf_counter()
        self.metrics.backpressure_seconds.inc(now - since)
        return now

    def next_problems(self, holder: str) -> Drawn:
        """The next round's problems, drawn under ``holder``'s claim; those too long for the model are left out
        (their positions in ``too_long``)."""
        return self.prompt_ids.fitting(self.prompts.draw(self.cfg.actor.prompts_per_round, holder))

    def sampled(self, rnd: Round) -> Round:
        """A generated round, counted; its version (the reply's, see actor.rounds) stamps its groups, unless
        their tokens say which versions produced them (in-flight updates: then the newest)."""
        self.version_sampled = rnd.version
        if self.updates is not None:
            self.updates.new_round()
        self.metrics.generation_seconds.observe((rnd.generated or time.perf_counter()) - rnd.started)
        groups = rnd.samples
        self.metrics.completions.inc(sum(len(g) for g in groups))
        self.metrics.tokens.inc(sum(len(s.token_ids) for g in groups for s in g))
        ends, calls = episode_counts([s for g in groups for s in g])  # nothing for single answers
        for end, count in ends.items():
            self.metrics.episodes.labels(end).inc(count)
        self.metrics.tool_calls.inc(calls)
        return rnd

    def grade(self, problems: list[Problem], groups: list[list[Sample]]) -> list[list[float]]:
        self.liveness.beat("grading")
        t0 = time.perf_counter()
        n = self.cfg.sampling.group_size
        result = self.grader.grade_samples(
            self.engine.tokenizer,
            [s for g in groups for s in g],
            [p.reference for p in problems for _ in range(n)],
            require_stop=self.cfg.task.require_stop,
            prompts=[p.prompt for p in problems for _ in range(n)],
        )
        for kind, count in result.errors.items():
            self.metrics.grader_errors.labels(kind).inc(count)
        self.metrics.grader_seconds.observe(time.perf_counter() - t0)
        self.metrics.reward.set(float(np.mean(result.scores)))
        return [result.scores[i : i + n] for i in range(0, len(result.scores), n)]

    def send(self, rnd: Round, rewards: list[list[float]]) -> None:
        """Filter zero-std groups (DAPO) and XADD the rest in one transaction with this round's counters and the
        summary of what was filtered (for the learner's reward figures; counted in Redis, not carried by a group),
        settling the round's claim with the fate of each of its prompt positions (actor.outgoing)."""
        self.liveness.beat("sending")
        out = self.outgoing.encode(rnd.problems, rnd.samples, rewards, prompt_ids=self.prompt_ids,
                                   version_sampled=self.version_sampled, epochs=self.disk.epochs,
                                   positions=rnd.positions)  # fmt: skip
        out.counters.update(rnd.unsampled)
        if self._produce(out, rnd.holder):
            self._count_sent(out)
        self.prompts.record(rnd.problems, rewards)  # what each problem taught, sent or not (difficulty sampling)

    def _produce(self, out: Outgoing, holder: str) -> bool:
        """Write the round, settling its claim on its prompt positions; False when it was discarded instead (the
        run ended, stopping ran out of time, or the claim was lost)."""
        # The bound is checked again with the writes, atomically: many actors together never overshoot it. A round
        # that does not fit waits whole (never half a round), also when the actor is asked to stop: then for up to
        # actor.stop_send_timeout_s, past which it is discarded, counted.
        bound = self.cfg.actor.max_stream_groups
        deadline: float | None = None
        while True:
            try:
                if self.transport.produce(out.payloads, dict(out.counters), bound=bound, holder=holder,
                                          filtered=out.filtered, max_bytes=self.max_message_bytes,
                                          claim=True) is not None:  # fmt: skip
                    return True
            except ClaimLost as e:
                self._claim_lost(out, holder, e)
                return False
            if self.transport.is_done():  # the learner reads no more
                self._discard(out, "run_done", holder)
                return False
            if self.stop.is_set() and deadline is None:
                deadline = time.monotonic() + self.cfg.actor.stop_send_timeout_s
                log.info("stopping: waiting up to %.0fs for room to send the round in hand (%d groups)",
                         self.cfg.actor.stop_send_timeout_s, len(out.payloads))  # fmt: skip
            if deadline is not None and time.monotonic() >= deadline:
                self._discard(out, "stopped", holder)
                return False
            self._wait(lambda: not round_fits(self.transport.unread(), len(out.payloads), bound), deadline=deadline)

    def _count_sent(self, out: Outgoing) -> None:
        self.groups_sent += len(out.payloads)
        self.rounds += 1
        self.metrics.groups_produced.inc(len(out.payloads))
        if out.counters[FILTERED_ZERO_STD]:
            self.metrics.groups_filtered.labels("zero_std").inc(out.counters[FILTERED_ZERO_STD])
        if out.counters[FORWARDED]:
            self.metrics.groups_forwarded.inc(out.counters[FORWARDED])

    def _discard(self, out: Outgoing, reason: str, holder: str) -> None:
        """A round that will not be sent: counted as ``groups_discarded:<reason>`` (with its other counters and what
        it filtered)."""
        log.warning("discarding a round of %d groups: %s", len(out.payloads) + out.unsent, reason.replace("_", " "))
        try:
            self.transport.produce([], dict(out.discarded(reason)), holder=holder, filtered=out.filtered, claim=True)
        except ClaimLost as e:
            self._claim_lost(out, holder, e)

    def _refused(self, rnd: Round) -> bool:
        """A round generated (in part) by weights their learner never announced (actor.engines.sglang.unannounced):
        discarded, counted as ``groups_discarded:unannounced`` with its positions."""
        if rnd.refused:
            log.warning("%s", rnd.refused)
            self._discard(Outgoing.unsendable(len(rnd.problems), rnd.unsampled), "unannounced", rnd.holder)
        return bool(rnd.refused)

    def _claim_lost(self, out: Outgoing | None, holder: str, e: ClaimLost) -> None:
        """The round's positions went to other actors while this one was gone past its lease: sent, they would repeat
        prompts. Its groups are discarded (``groups_discarded:claim_lost``, with what it filtered); its positions are
        counted where they went (``prompts_requeued:lost``). ``out`` None: a round still drawing (difficulty)."""
        what = "a round still drawing its prompts" if out is None else f"a round of {len(out.payloads)} groups"
        log.warning("discarding %s: %s (this actor was stopped or cut off for longer than run.heartbeat_ttl_s; "
                    "other actors draw its prompts again)", what, e)  # fmt: skip
        counters = {} if out is None else dict(out.discarded("claim_lost"))
        counters = {k: n for k, n in counters.items() if not k.startswith("prompts_")}
        filtered = None if out is None else out.filtered
        if not (counters and self.transport.produce([], counters, holder=holder, filtered=filtered)):
            self.transport.release_round(holder)  # (its reservation; no claim is left to give back)

    def _beat_info(self) -> dict[str, Any]:
        return {"version": self.engine.version, "groups_sent": self.groups_sent, "rounds": self.rounds}
