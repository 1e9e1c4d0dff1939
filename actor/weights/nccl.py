"""The actor's side of ``weights.transport: nccl`` (the protocol: common/weights/nccl.py).

Between two rounds of sampling (never during one: every completion is sampled with one version) the actor looks for a
round of the learner that names it, says it is ready, and waits for the learner's decision: ``cancel``, and the
version will come from disk as usual; ``go``, and it joins the round's update group if that is a new one (leaving the
one it had) and its engine receives the buckets. Every wait is bounded by ``weights.nccl_timeout_s``. The slowest member
decides when a version goes out: actors that finish their round first wait for it (at most about one round).

What arrived is taken into service only once the learner that sent it announced it, behind its lease's fence: the
announcement of exactly that round (common.weights.nccl.announcement_uri). Until then the local engine keeps the
buckets aside and samples with the version it had; a SGLang server has loaded them as they came, so its engine
samples nothing. An announcement of anything else (another learner's version of the same number, a version written
to disk instead), or none within ``weights.nccl_timeout_s``, and what arrived is dropped: the local engine never
applied it, and a SGLang server holds weights nobody announced, like a server that took part of a version, until a
whole announced one is loaded (over NCCL or from disk).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from typing import Any

from actor.engines.base import NcclEngine
from common.config import Config
from common.metrics import ActorMetrics
from common.schemas import NcclRound, SchemaError, WeightsAnnouncement
from common.transport import ActorTransport
from common.weights import WeightsError
from common.weights.nccl import announcement_uri

log = logging.getLogger(__name__)


class Receiver:
    def __init__(
        self,
        cfg: Config,
        member: str,
        transport: ActorTransport,
        engine: NcclEngine,
        metrics: ActorMetrics,
        stop: threading.Event,
    ):
        self.cfg = cfg
        self.stop = stop  # the actor was asked to stop: no new wait begins
        self.member = member
        self.transport = transport
        self.engine = engine
        self.metrics = metrics
        self.group: str | None = None  # the update group this actor's engine is in
        self.last: str | None = None  # the id of the last round handled
        self.nonce = uuid.uuid4().hex[:8]  # this process's: a restarted actor with the same id is a new member

    def register(self) -> None:
        """Called with every heartbeat, and when the group it is in changes: the learner forms groups of the actors
        registered recently, and a new one when a member is not in the group it was formed into."""
        info = {"ranks": self.engine.capabilities.nccl_ranks, "nonce": self.nonce, "group": self.group}
        self.transport.nccl_register(self.member, info)

    def unregister(self) -> None:
        """Best effort, on the way out (Redis or the server may be what failed): an entry left behind ages out."""
        try:
            self.transport.nccl_unregister(self.member)
            if self.group is not None:
                self.engine.leave_group(self.group)
        except Exception as e:
            log.debug("leaving the update group: %s", e)
        self.group = None

    def _leave(self) -> None:
        if self.group is not None:
            self.engine.leave_group(self.group)
            self.group = None
            self.register()

    def _decision(self, nccl_round: NcclRound, waiting_for: tuple[str, ...], heartbeat: Any) -> str:
        """Wait for one of the learner's decisions on ``nccl_round``, longer than the learner itself waits for its
        members (its decision, cancel included, is what ends the wait)."""
        deadline = time.monotonic() + 1.5 * self.cfg.weights.nccl_timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            decision = self.transport.nccl_decision(nccl_round.id)
            if decision in waiting_for or decision == "cancel":
                return decision
            heartbeat()
            time.sleep(0.02)
        return "no decision in time"

    def poll(self, heartbeat: Any = lambda: None) -> bool:
        """A :class:`actor.weights.WeightsSource`: take part in the learner's current round if it names this actor and
        is undecided. Returns True when a version arrived."""
        if self.stop.is_set():
            return False
        nccl_round = self.transport.nccl_round()  # SchemaError when malformed, naming what is wrong
        if nccl_round is None:
            return False
        if nccl_round.id == self.last or self.member not in nccl_round.ranks:
            return False
        self.last = nccl_round.id
        if self.transport.nccl_decision(nccl_round.id) is not None:  # decided without us (we came too late): next time
            return False
        timeout = self.cfg.weights.nccl_timeout_s
        t0 = time.perf_counter()
        self.transport.nccl_ready(nccl_round.id, self.member)
        decision = self._decision(nccl_round, ("join", "go"), heartbeat)
        if decision == "join":  # a new group: every member joins it now, the learner too
            self._leave()
            try:
                reachable(nccl_round.address, nccl_round.port, min(timeout, 10.0))
                self.engine.join_group(nccl_round, nccl_round.ranks[self.member], timeout)
            except WeightsError as e:  # the learner's join fails too, and it forms a new group next time
                log.warning("could not join the update group %s: %s", nccl_round.group, e)
                return False
            self.group = nccl_round.group
            self.register()
            decision = self._decision(nccl_round, ("go",), heartbeat)
        if decision != "go":
            log.info("weights v%d: the learner cancelled its broadcast (%s); it comes from disk", nccl_round.version,
                     decision)  # fmt: skip
            return False
        if (
            nccl_round.group != self.group
        ):  # not the group we are in (should not happen: the learner forms a new one then)
            log.warning(
                "weights v%d go to update group %s, this actor is in %s",
                nccl_round.version,
                nccl_round.group,
                self.group,
            )
            return False
        try:
            nbytes = self.engine.receive(nccl_round, timeout)
        except WeightsError as e:  # (an EngineError, a server that stopped answering, ends the actor)
            # The group may be broken now: leave it; the learner forms a new one for the next version.
            log.warning("%s; it comes from disk", e)
            self._leave()
            return False
        return self._serve(nccl_round, heartbeat, t0, nbytes)

    def _serve(self, nccl_round: NcclRound, heartbeat: Any, t0: float, nbytes: int) -> bool:
        """The round's buckets arrived: serve them once its learner has announced them (behind its fence), else
        drop them."""
        try:
            why = self._announcement(nccl_round, heartbeat)
        except BaseException:  # (Redis gone past its retries: the actor stops; nothing unannounced is kept)
            self.engine.discard(nccl_round)
            raise
        if why:
            self.engine.discard(nccl_round)
            log.warning(
                "weights v%d arrived over NCCL (round %s) but %s: not used", nccl_round.version, nccl_round.id, why
            )
            return False
        try:
            self.engine.commit(nccl_round)
        except WeightsError as e:  # (they did not fit the model: it is as it was)
            log.warning("%s; it comes from disk", e)
            return False
        seconds = time.perf_counter() - t0
        self.metrics.weight_load_seconds.labels("nccl").observe(seconds)
        self.metrics.policy_version.set(nccl_round.version)
        log.debug("received weights v%d (%.1f MB) over NCCL in %.3fs, announced (round %s)", nccl_round.version,
                  nbytes / 1e6, seconds, nccl_round.id)  # fmt: skip
        return True

    def _announcement(self, nccl_round: NcclRound, heartbeat: Any) -> str:
        """Wait for the announcement of ``nccl_round`` (the learner writes it, behind its fence, once its broadcast is
        complete): '' once ``weights:latest`` names the round; else why not: it announces another version of that
        number or above (another learner's, or the version went to disk), or changed to another one, or none came
        within ``weights.nccl_timeout_s``."""
        deadline = time.monotonic() + self.cfg.weights.nccl_timeout_s
        before = self._latest()
        while True:
            ann = self._latest()
            if announces(ann, nccl_round):
                return ""
            if ann is not None and (ann != before or ann.version >= nccl_round.version):  # a newer one, or another's
                return f"weights:latest announces v{ann.version} ({ann.uri}) instead"
            if self.stop.is_set():
                return "the actor is stopping"
            if time.monotonic() > deadline:
                return f"its learner did not announce it within {self.cfg.weights.nccl_timeout_s:.0f}s"
            heartbeat()
            time.sleep(0.02)

    def _latest(self) -> WeightsAnnouncement | None:
        try:
            return self.transport.latest_weights()
        except SchemaError:  # garbage in weights:latest names no round; the actor's loop says so
            return None


def announces(ann: WeightsAnnouncement | None, nccl_round: NcclRound) -> bool:
    """Whether ``ann`` is the announcement of the version sent in ``nccl_round`` (by its learner, under its fence)."""
    return (
        ann is not None
        and ann.format == "nccl"
        and ann.version == nccl_round.version
        and ann.uri == announcement_uri(nccl_round)
    )


def reachable(address: str, port: int, timeout_s: float) -> None:
    """The learner's rendezvous accepts connections (it starts listening as it says ``join``): checked before a
    SGLang server is sent into a rendezvous it could wait in for half an hour. Raises WeightsError naming
    weights.nccl_address otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((address, port), timeout=2.0):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise WeightsError(
                    f"the learner's rendezvous at {address}:{port} cannot be reached ({e}): is weights.nccl_address "
                    "an address this actor reaches?"
                ) from None
            time.sleep(0.1)
