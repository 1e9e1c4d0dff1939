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

from actor.engine_protocol import BetweenRounds, Engine, EngineError, load_if_due
from actor.filter import Decision, ZeroStdFilter, filtered_stats, overlong_penalties, shaped
from actor.inflight import InFlight, Round, rounds_in_flight, sampled_aside
from actor.message import group_message
from actor.nccl_weights import NcclEngine, Receiver, supports_nccl
from actor.prompts import PromptSource
from actor.updates import Backoff, announcement_key, in_flight_updates, same_lineage
from common.config import Config
from common.metrics import ActorMetrics
from common.model.generation import Sample
from common.model.limits import message_byte_limit
from common.schemas import FORWARDED, FilteredStats, SchemaError, WeightsAnnouncement, counter, encode_group
from common.tasks import Problem, PromptEncoder, make_task
from common.transport import ActorTransport, Admission, round_fits
from common.weights import WeightsError
from grader.episodes import Episodes, episode_counts
from grader.pool import GraderPool

log = logging.getLogger("actor")
_FILTERED_ZERO_STD = counter("filtered", "zero_std")  # the stats field of the groups the zero-std filter keeps back
_DISCARDED_OVERSIZED = counter("discarded", "oversized")  # groups over redis.max_message_bytes, never sent


class Actor:
    def __init__(
        self,
        cfg: Config,
        actor_id: str,
        transport: ActorTransport,
        engine: Engine,
        grader: GraderPool,
        metrics: ActorMetrics,
        prompt_limit: int | None = None,
        episodes: Episodes | None = None,
    ):
        self.cfg = cfg
        # Prompts longer than this leave no room for an answer within the model's positions: skipped, counted.
        self.prompt_limit = prompt_limit
        self.id = actor_id
        self.transport = transport
        self.engine = engine
        self.grader = grader
        self.metrics = metrics
        self.task = make_task(cfg.task, cfg.run.seed)
        self.encode = PromptEncoder(engine.tokenizer, cfg.task)
        self.prompts = PromptSource(cfg, self.task, transport, metrics)
        self.filter = ZeroStdFilter(cfg.actor.filter_zero_std, cfg.actor.max_consecutive_filtered)
        self.stop = threading.Event()
        lc = cfg.learner
        self.admission = Admission(cfg.actor.max_stream_groups, lc.batch_groups, lc.max_staleness, lc.publish_every - 1)
        self.max_message_bytes = message_byte_limit(cfg)
        self.groups_sent = 0
        self.rounds = 0
        self.version_sampled = engine.version  # the policy version of the round being graded and sent
        self.in_flight = InFlight(actor_id, engine, rounds_in_flight(cfg, engine), sampled_aside(cfg, engine), episodes)
        # actor.weight_updates in_flight: versions loaded while rounds are sampled (actor.updates)
        self.updates = in_flight_updates(cfg, engine, self._newer, self._load, lambda: bool(self._pubsub.get_message()),
                                         lambda a: same_lineage(self._epochs, self.engine.version, a))  # fmt: skip
        self._epochs: dict[int, int] = {}  # version -> epoch, from the announcements this actor read
        self._prompt_ids: dict[str, list[int]] = {}
        self._malformed_seen: set[str] = set()  # reasons already said for malformed announcements
        self._load_backoff = Backoff()  # an announcement that failed to load is not tried again every round
        self._warned_forward = False
        self._warned_long = False
        self._next_heartbeat = 0.0
        self._beat_lock = threading.Lock()  # the heartbeat thread and the loop beat alike
        self._beats_stop = threading.Event()
        self._pubsub: Any = None
        self._warned_nccl = False
        self.receiver: Receiver | None = None  # weights.transport nccl, with an engine that takes weights that way
        if cfg.weights.transport == "nccl" and supports_nccl(engine):
            self.receiver = Receiver(cfg, actor_id, transport, cast(NcclEngine, engine), metrics, self.stop)

    # -- the loop -----------------------------------------------------------------------------------------------

    def run(self) -> str:
        """Returns why it stopped."""
        self._pubsub = self.transport.subscribe_weights()
        beats = threading.Thread(target=self._beat_forever, name="heartbeat", daemon=True)
        beats.start()
        try:
            while not self.stop.is_set():
                self.heartbeat()
                if self.transport.is_done():
                    return "the learner finished the run"
                if self.receiver is not None:
                    self.receiver.poll(self.heartbeat)
                self.reload_weights()
                if self.engine.version < 0:  # a version arrived in part: sample nothing until a whole one is loaded
                    self._wait(lambda: self.engine.version < 0)
                    continue
                rnd = self.next_round()
                if rnd is None:
                    continue
                self.send(rnd, self.grade(rnd.problems, rnd.samples))
                if self.cfg.actor.synchronous:
                    self.wait_for_new_version()
            self._send_rounds_in_flight()
            return "asked to stop"
        finally:
            self._beats_stop.set()
            beats.join()
            self.in_flight.close()
            self._release_round()
            self._pubsub.close()
            if self.receiver is not None:
                self.receiver.unregister()

    # -- steps --------------------------------------------------------------------------------------------------

    def reload_weights(self) -> None:
        """Load the announced version if it differs from ours, between rounds (in flight, an engine's other rounds
        are paused for it, see actor.sglang_engine, unless a restarted learner published it; else they finish)."""
        ann = self._newer()
        if ann is None:
            return
        if self.updates is None or not same_lineage(self._epochs, self.engine.version, ann):
            self.in_flight.settle(self.heartbeat)  # no request of ours between the update and its cache flush
        self._load(ann)

    def _newer(self) -> WeightsAnnouncement | None:
        """The announced version when it should be loaded now: it differs from ours, its weights are on disk, and a
        failed load of it is not waiting out its backoff."""
        while self._pubsub.get_message() is not None:  # announcements only wake us; the hash is the truth
            pass
        ann = self.announced()
        self._remember_epoch(ann)
        if ann is None or ann.version == self.engine.version:
            return None
        if ann.format == "nccl":  # sent to the members of the update group only; the others wait for a disk version
            if self.receiver is None and not self._warned_nccl:
                self._warned_nccl = True
                log.warning(
                    "weights v%d went over NCCL (weights.transport nccl) and this actor's engine cannot take them "
                    "that way: it loads the versions written to disk (weights.disk_every; warned once)",
                    ann.version,
                )
            return None
        if self._load_backoff.waiting(announcement_key(ann), time.monotonic()):
            return None
        return ann

    def _load(self, ann: WeightsAnnouncement) -> bool:
        """Load ``ann`` into the engine; False when it kept its weights (refused: counted, backed off; or a version
        it takes only between rounds, asked for mid-round)."""
        key = announcement_key(ann)
        t0 = time.perf_counter()
        try:
            nbytes = self.engine.load(ann)
        except BetweenRounds:
            return False
        except WeightsError as e:  # the engine kept its weights and version (e.g. pruned meanwhile, or not ours)
            self.metrics.weight_load_failures.labels(e.reason).inc()
            delay = self._load_backoff.failed(key, time.monotonic())
            log.warning("could not load weights v%d (attempt %d): %s; sampling on with v%d, trying it again %s "
                        "unless a newer version is announced", ann.version, self._load_backoff.attempts, e,
                        self.engine.version, f"in {delay:.0f}s" if delay else "next round")  # fmt: skip
            return False
        seconds = time.perf_counter() - t0
        self.metrics.weight_load_seconds.labels("disk").observe(seconds)
        self.metrics.policy_version.set(ann.version)
        log.debug("loaded weights v%d (%.1f MB) in %.3fs", ann.version, nbytes / 1e6, seconds)
        return True

    def _remember_epoch(self, ann: WeightsAnnouncement | None) -> None:
        """Which epoch announced each version (whatever path its weights take, NCCL or disk): groups carry the
        epoch of the weights they were sampled with, so the learner can tell a crashed learner's dead branch."""
        if ann is None:
            return
        if len(self._epochs) >= 64:  # recent versions only
            self._epochs.clear()
        self._epochs[ann.version] = ann.epoch

    def announced(self) -> WeightsAnnouncement | None:
        """The announced version; None when there is none, or when ``weights:latest`` is malformed (written by hand
        or by a newer build): that is bad input, said once per distinct value and counted, and the actor samples on
        with the weights it has until the learner's next announcement replaces it."""
        try:
            return self.transport.latest_weights()
        except SchemaError as e:
            if str(e) not in self._malformed_seen:
                if len(self._malformed_seen) >= 64:  # a bounded memory of what was said
                    self._malformed_seen.clear()
                self._malformed_seen.add(str(e))
                self.metrics.weights_malformed.inc()
                log.warning("ignoring weights:latest: %s (the learner's next announcement replaces it)", e)
            return None

    def wait_for_new_version(self) -> None:
        """The synchronous baseline (actor.synchronous): sample again only with weights newer than this round's
        (the wait counts as backpressure)."""

        def behind() -> bool:
            ann = self.announced()
            return ann is None or ann.version <= self.version_sampled

        # An announcement that arrived while this round was sampled (the previous version's) must not end the wait.
        self._wait(behind, until_clear=True)

    def next_round(self) -> Round | None:
        """Start rounds while a slot is free and there is room, then the oldest round once generated; None when the
        loop should re-check its exit conditions first (no room, or no prompt of the round fit)."""
        while (holder := self.in_flight.free_holder()) is not None:
            if not (self.wait_for_room(holder) if not self.in_flight.pending else self._reserve_round(holder)):
                break
            problems = self.next_problems()
            if not problems:  # every prompt of the round was too long
                self.transport.release_round(holder)
                self.stop.wait(0.1)
                break
            prompts = [self._encode_prompt(p) for p in problems]
            self.in_flight.start(holder, problems, prompts, self.cfg.sampling.group_size)
        if not self.in_flight.pending:
            return None
        return self.sampled(self.in_flight.finish_oldest(self._while_sampling))

    def _while_sampling(self) -> None:
        """Called every 0.2 s while the actor waits for a round: heartbeats, and with in-flight updates on an engine
        that samples in other threads (SGLang's rounds), a new version loaded as soon as it is announced."""
        self.heartbeat()
        if self.updates is not None and getattr(self.engine, "updates", None) is None:
            load_if_due(self.updates)

    def _send_rounds_in_flight(self) -> None:
        """Asked to stop: the rounds already generating are finished and sent (each within
        ``actor.stop_send_timeout_s`` of room), as the one round in hand always was."""
        while self.in_flight.pending:
            rnd = self.sampled(self.in_flight.finish_oldest(self.heartbeat))
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
        """Best effort, on the way out (Redis may be what failed): a reservation left behind ends with its lease."""
        try:
            for holder in self.in_flight.holders():
                self.transport.release_round(holder)
        except Exception as e:
            log.debug("releasing the rounds' reservations: %s", e)

    def _wait(self, blocked: Callable[[], bool], *, until_clear: bool = False, deadline: float | None = None) -> None:
        """Wait while ``blocked()``, counted as backpressure; a weights announcement ends the wait early so that the
        caller re-checks its conditions, unless ``until_clear``. The run ending or a stop request always ends it,
        except with a ``deadline`` (a ``time.monotonic()`` value: a stopping actor waiting to send its last round),
        which ends it instead."""
        t0 = time.perf_counter()
        while (deadline is not None or not self.stop.is_set()) and blocked():
            t0 = self._count_wait(t0)
            if deadline is not None and time.monotonic() >= deadline:
                break
            self.heartbeat()  # waiting is working: the key must not expire
            if why := getattr(self.engine, "failed", lambda: None)():  # a launched server that died meanwhile
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

    def next_problems(self) -> list[Problem]:
        problems = self.prompts.draw(self.cfg.actor.prompts_per_round)
        if self.prompt_limit is None:
            return problems
        fitting = [p for p in problems if len(self._encode_prompt(p)) <= self.prompt_limit]
        if len(fitting) < len(problems):
            self.metrics.prompts_skipped.inc(len(problems) - len(fitting))
            if not self._warned_long:
                self._warned_long = True
                longest = max(len(self._encode_prompt(p)) for p in problems)
                log.warning(
                    "skipping training prompts longer than %d tokens (one has %d): raise the model's positions or "
                    "lower sampling.max_new_tokens, or shorten the template (counted as "
                    "grpo_actor_prompts_skipped_total; warned once)",
                    self.prompt_limit,
                    longest,
                )
        return fitting

    def _encode_prompt(self, problem: Problem) -> list[int]:
        ids = self._prompt_ids.get(problem.id)
        if ids is None:
            if len(self._prompt_ids) >= 10_000:  # a cache of recent prompts, not of a whole large dataset
                self._prompt_ids.clear()
            ids = self._prompt_ids[problem.id] = self.encode(problem.prompt)
        return ids

    def sampled(self, rnd: Round) -> Round:
        """A generated round, counted; its version (the reply's, see actor.inflight) stamps its groups, unless
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
        summary of what was filtered (for the learner's reward figures; counted in Redis, not carried by a group)."""
        payloads, counters, filtered = self._filter_and_encode(rnd.problems, rnd.samples, rewards)
        if self._produce(payloads, counters, filtered, rnd.holder):
            self._count_sent(payloads, counters)
        self.prompts.record(rnd.problems, rewards)  # what each problem taught, sent or not (difficulty sampling)

    def _filter_and_encode(
        self, problems: list[Problem], groups: list[list[Sample]], rewards: list[list[float]]
    ) -> tuple[list[bytes], Counter[str], FilteredStats]:
        """The round's group messages to send, its counters, and the summary of the groups it filtered out."""
        payloads: list[bytes] = []
        counters: Counter[str] = Counter()
        filtered = FilteredStats()
        for problem, samples, r in zip(problems, groups, rewards, strict=True):
            # An episode's length is its last turn's, which sampling.max_new_tokens bounds as it bounds an answer.
            lengths = [len(x.token_ids) - x.answer_from for x in samples]
            penalties = overlong_penalties(lengths, self.cfg.sampling, self.cfg.shaping)
            decision = self.filter.decide(shaped(r, penalties))
            if decision is Decision.FILTER:
                filtered += filtered_stats(r)
                counters[_FILTERED_ZERO_STD] += 1
                continue
            if decision is Decision.FORWARD:
                counters[FORWARDED] += 1
                self._warn_forward_once()
            message = group_message(
                problem,
                self._encode_prompt(problem),
                samples,
                r,
                penalties,
                forwarded=decision is Decision.FORWARD,
                actor_id=self.id,
                version_sampled=self.version_sampled,
                epochs=self._epochs,
            )
            payload = encode_group(message)
            if len(payload) > self.max_message_bytes:  # the write script would refuse the round: not this group
                counters[_DISCARDED_OVERSIZED] += 1
                log.warning("discarding a group of %d bytes, over redis.max_message_bytes (%d)", len(payload),
                            self.max_message_bytes)  # fmt: skip
                continue
            payloads.append(payload)
        return payloads, counters, filtered

    def _produce(self, payloads: list[bytes], counters: Counter[str], filtered: FilteredStats, holder: str) -> bool:
        """Write the round; False when it was discarded instead (the run ended, or stopping ran out of time)."""
        # The bound is checked again with the writes, atomically: many actors together never overshoot it. A round
        # that does not fit waits whole (never half a round), also when the actor is asked to stop: then for up to
        # actor.stop_send_timeout_s, past which it is discarded, counted.
        bound = self.cfg.actor.max_stream_groups
        deadline: float | None = None
        limit = self.max_message_bytes
        while self.transport.produce(payloads, dict(counters), bound=bound, holder=holder, filtered=filtered,
                                     max_bytes=limit) is None:  # fmt: skip
            if self.transport.is_done():  # the learner reads no more
                self._discard(payloads, counters, filtered, "run_done", holder)
                return False
            if self.stop.is_set() and deadline is None:
                deadline = time.monotonic() + self.cfg.actor.stop_send_timeout_s
                log.info("stopping: waiting up to %.0fs for room to send the round in hand (%d groups)",
                         self.cfg.actor.stop_send_timeout_s, len(payloads))  # fmt: skip
            if deadline is not None and time.monotonic() >= deadline:
                self._discard(payloads, counters, filtered, "stopped", holder)
                return False
            self._wait(lambda: not round_fits(self.transport.unread(), len(payloads), bound), deadline=deadline)
        return True

    def _count_sent(self, payloads: list[bytes], counters: Counter[str]) -> None:
        self.groups_sent += len(payloads)
        self.rounds += 1
        self.metrics.groups_produced.inc(len(payloads))
        if counters[_FILTERED_ZERO_STD]:
            self.metrics.groups_filtered.labels("zero_std").inc(counters[_FILTERED_ZERO_STD])
        if counters[FORWARDED]:
            self.metrics.groups_forwarded.inc(counters[FORWARDED])

    def _discard(
        self, payloads: list[bytes], counters: Counter[str], filtered: FilteredStats, reason: str, holder: str
    ) -> None:
        """A round that will not be sent: counted as ``groups_discarded:<reason>`` (with the round's other counters
        and what it filtered), so that the sampling it cost shows."""
        log.warning("discarding a round of %d groups: %s", len(payloads), reason.replace("_", " "))
        counters = Counter({**counters, counter("discarded", reason): len(payloads)})
        self.transport.produce([], dict(counters), holder=holder, filtered=filtered)

    def _warn_forward_once(self) -> None:
        if not self._warned_forward:
            self._warned_forward = True
            log.warning(
                "%d groups in a row had equal rewards (prompts too easy or too hard for the model): sending zero-std "
                "groups flagged so the learner does not starve (counted as zero_std_forwarded; warned once)",
                self.cfg.actor.max_consecutive_filtered,
            )

    def heartbeat(self) -> None:
        """Refresh ``actors:<id>`` (and the NCCL registration) when a third of its TTL has passed since the last
        beat. Called by the loop and by the heartbeat thread (Redis clients are thread-safe)."""
        with self._beat_lock:
            now = time.monotonic()
            if now < self._next_heartbeat:
                return
            ttl = self.cfg.run.heartbeat_ttl_s
            self._next_heartbeat = now + ttl / 3
            info = {"version": self.engine.version, "groups_sent": self.groups_sent, "rounds": self.rounds}
            self.transport.heartbeat(self.id, ttl, info)
            for holder in self.in_flight.holders():  # a round longer than the lease keeps its room
                self.transport.renew_reservation(holder, ttl)
            if self.receiver is not None:
                self.receiver.register()

    def _beat_forever(self) -> None:
        """The heartbeat thread: sampling and grading a round may take longer than the TTL, and an actor whose key
        expires leaves the NCCL update group (and ``grpo status``) while it works. A failed beat is logged and tried
        again; the loop meets the same Redis and decides whether to give up."""
        every = self.cfg.run.heartbeat_ttl_s / 6  # well within the third of the TTL a beat is due after
        while not self._beats_stop.wait(every):
            try:
                self.heartbeat()
            except Exception as e:
                log.warning("heartbeat failed: %s", e)
