"""Versions from the shared volume: the one ``weights:latest`` announces, verified and loaded into the engine (its
digest checked by the engine's load), counted and timed; a version that fails to load is tried again with a backoff
(:class:`actor.weights.mid_round.Backoff`), and a malformed announcement is said once and counted, the engine sampling
on with what it has. Which learner lineage (epoch) announced each version is remembered: groups carry it, and a
restarted learner's versions are loaded only between rounds (:func:`actor.weights.mid_round.same_lineage`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from actor.engines.base import BetweenRounds, Engine
from actor.weights.mid_round import Backoff, announcement_key, same_lineage
from common.metrics import ActorMetrics
from common.schemas import SchemaError, WeightsAnnouncement
from common.transport import ActorTransport
from common.weights import WeightsError

log = logging.getLogger("actor")


class DiskWeights:
    def __init__(self, transport: ActorTransport, engine: Engine, metrics: ActorMetrics, *, over_nccl: bool):
        self.transport = transport
        self.engine = engine
        self.metrics = metrics
        self.over_nccl = over_nccl  # versions sent over NCCL reach this engine that way (actor.weights.nccl)
        self.drain: Callable[[], object] = lambda: None  # the announcements channel's messages, read and dropped
        # Called before a version is loaded between rounds (the actor's rounds in flight settle first, where needed).
        self.before_load: Callable[[WeightsAnnouncement], None] = lambda ann: None
        self.backoff = Backoff()  # an announcement that failed to load is not tried again every round
        self.epochs: dict[int, int] = {}  # version -> epoch, from the announcements this actor read
        self._malformed_seen: set[str] = set()  # reasons already said for malformed announcements
        self._warned_nccl = False

    def poll(self, waiting: Callable[[], None]) -> bool:
        """A :class:`actor.weights.WeightsSource`: the announced version, loaded if it should be now."""
        ann = self.newer()
        if ann is None:
            return False
        self.before_load(ann)
        return self.load(ann)

    def newer(self) -> WeightsAnnouncement | None:
        """The announced version when it should be loaded now: it differs from the engine's, its weights are on
        disk, and a failed load of it is not waiting out its backoff."""
        while self.drain() is not None:  # announcements only wake the actor; the hash is the truth
            pass
        ann = self.announced()
        self._remember_epoch(ann)
        if ann is None or ann.version == self.engine.version:
            return None
        if ann.format == "nccl":  # sent to the members of the update group only; the others wait for a disk version
            if not self.over_nccl and not self._warned_nccl:
                self._warned_nccl = True
                log.warning(
                    "weights v%d went over NCCL (weights.transport nccl) and this actor's engine cannot take them "
                    "that way: it loads the versions written to disk (weights.disk_every; warned once)",
                    ann.version,
                )
            return None
        if self.backoff.waiting(announcement_key(ann), time.monotonic()):
            return None
        return ann

    def load(self, ann: WeightsAnnouncement) -> bool:
        """Load ``ann`` into the engine; False when it kept its weights (refused: counted, backed off; or a version
        it takes only between rounds, asked for mid-round)."""
        t0 = time.perf_counter()
        try:
            nbytes = self.engine.load(ann)
        except BetweenRounds:
            return False
        except WeightsError as e:  # the engine kept its weights and version (e.g. pruned meanwhile, or not ours)
            self.metrics.weight_load_failures.labels(e.reason).inc()
            delay = self.backoff.failed(announcement_key(ann), time.monotonic())
            log.warning("could not load weights v%d (attempt %d): %s; sampling on with v%d, trying it again %s "
                        "unless a newer version is announced", ann.version, self.backoff.attempts, e,
                        self.engine.version, f"in {delay:.0f}s" if delay else "next round")  # fmt: skip
            return False
        seconds = time.perf_counter() - t0
        self.metrics.weight_load_seconds.labels("disk").observe(seconds)
        self.metrics.policy_version.set(ann.version)
        log.debug("loaded weights v%d (%.1f MB) in %.3fs", ann.version, nbytes / 1e6, seconds)
        return True

    def same_lineage(self, ann: WeightsAnnouncement) -> bool:
        """Whether ``ann`` comes from the learner lineage that published the version the engine holds."""
        return same_lineage(self.epochs, self.engine.version, ann)

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

    def _remember_epoch(self, ann: WeightsAnnouncement | None) -> None:
        """Which epoch announced each version (whatever path its weights take, NCCL or disk): groups carry the
        epoch of the weights they were sampled with, so the learner can tell a crashed learner's dead branch."""
        if ann is None:
            return
        if len(self.epochs) >= 64:  # recent versions only
            self.epochs.clear()
        self.epochs[ann.version] = ann.epoch
