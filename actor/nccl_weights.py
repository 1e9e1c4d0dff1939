"""The actor's side of ``weights.transport: nccl`` (the protocol: common/weights/nccl.py).

Between two rounds of sampling (never during one: every completion is sampled with one version) the actor looks for a
round of the learner that names it, says it is ready, and waits for the learner's decision: ``cancel``, and the
version will come from disk as usual; ``go``, and it joins the round's update group if that is a new one (leaving the
one it had) and its engine receives the buckets. Every wait is bounded by ``weights.nccl_timeout_s``. The slowest member
decides when a version goes out: actors that finish their round first wait for it (at most about one round).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from typing import Any, Protocol

from common.config import Config
from common.metrics import ActorMetrics
from common.schemas import Round
from common.transport import ActorTransport
from common.weights import WeightsError

log = logging.getLogger(__name__)


class NcclEngine(Protocol):
    version: int
    nccl_ranks: int  # ranks its side of the group takes (a SGLang server's tensor-parallel size)

    def join_group(self, rnd: Round, rank_offset: int, timeout_s: float) -> None: ...

    def leave_group(self, group: str) -> None: ...

    def receive(self, rnd: Round, timeout_s: float) -> int:
        """Take the round's buckets (the learner is broadcasting them now) as version ``rnd.version``; returns the
        bytes received. Raises WeightsError when the engine kept its weights and can go on, EngineError when not."""
        ...


def supports_nccl(engine: Any) -> bool:
    """Whether the engine can join update groups (nccl_ranks 0: it could in general, this one cannot)."""
    methods = all(hasattr(engine, a) for a in ("join_group", "leave_group", "receive"))
    return methods and int(getattr(engine, "nccl_ranks", 0)) > 0


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
        info = {"ranks": self.engine.nccl_ranks, "nonce": self.nonce, "group": self.group}
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

    def _decision(self, rnd: Round, waiting_for: tuple[str, ...], heartbeat: Any) -> str:
        """Wait for one of the learner's decisions on ``rnd``, longer than the learner itself waits for its members
        (its decision, cancel included, is what ends the wait)."""
        deadline = time.monotonic() + 1.5 * self.cfg.weights.nccl_timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            decision = self.transport.nccl_decision(rnd.id)
            if decision in waiting_for or decision == "cancel":
                return decision
            heartbeat()
            time.sleep(0.02)
        return "no decision in time"

    def poll(self, heartbeat: Any = lambda: None) -> bool:
        """Take part in the learner's current round if it names this actor and is undecided. Returns True when a
        version arrived."""
        if self.stop.is_set():
            return False
        rnd = self.transport.nccl_round()  # SchemaError when malformed, naming what is wrong
        if rnd is None:
            return False
        if rnd.id == self.last or self.member not in rnd.ranks:
            return False
        self.last = rnd.id
        if self.transport.nccl_decision(rnd.id) is not None:  # decided without us (we came too late): next time
            return False
        timeout = self.cfg.weights.nccl_timeout_s
        t0 = time.perf_counter()
        self.transport.nccl_ready(rnd.id, self.member)
        decision = self._decision(rnd, ("join", "go"), heartbeat)
        if decision == "join":  # a new group: every member joins it now, the learner too
            self._leave()
            try:
                reachable(rnd.address, rnd.port, min(timeout, 10.0))
                self.engine.join_group(rnd, rnd.ranks[self.member], timeout)
            except WeightsError as e:  # the learner's join fails too, and it forms a new group next time
                log.warning("could not join the update group %s: %s", rnd.group, e)
                return False
            self.group = rnd.group
            self.register()
            decision = self._decision(rnd, ("go",), heartbeat)
        if decision != "go":
            log.info("weights v%d: the learner cancelled its broadcast (%s); it comes from disk", rnd.version,
                     decision)  # fmt: skip
            return False
        if rnd.group != self.group:  # not the group we are in (should not happen: the learner forms a new one then)
            log.warning("weights v%d go to update group %s, this actor is in %s", rnd.version, rnd.group, self.group)
            return False
        try:
            nbytes = self.engine.receive(rnd, timeout)
        except WeightsError as e:  # (an EngineError, a server that stopped answering, ends the actor)
            # The group may be broken now: leave it; the learner forms a new one for the next version.
            log.warning("%s; it comes from disk", e)
            self._leave()
            return False
        seconds = time.perf_counter() - t0
        self.metrics.weight_load_seconds.labels("nccl").observe(seconds)
        self.metrics.policy_version.set(rnd.version)
        log.debug("received weights v%d (%.1f MB) over NCCL in %.3fs", rnd.version, nbytes / 1e6, seconds)
        return True


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
