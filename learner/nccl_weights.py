"""The learner's side of ``weights.transport: nccl`` (the protocol: common/weights/nccl.py).

A :class:`Broadcaster` thread on rank 0 takes each version the learner hands it (a CPU snapshot, so training goes on
meanwhile) and runs a round: it forms a new update group when the members changed or one is not in the group it was
formed into, waits until every member is ready, has them join a new group (``join``), says ``go`` and broadcasts the
buckets, then announces the version. When anything does not happen within ``weights.nccl_timeout_s`` (a member never
readies, the group never forms, a bucket never completes) or anything else fails, it cancels or abandons the round,
writes the version to disk and announces that instead, and drops the group so that the next round forms a fresh
one. The training loop never waits on any of it: a version published while a round is in flight replaces the one
waiting for its turn (latest wins; counted as superseded).

A learner that lost the run writes nothing more from this thread: a fenced write refused (:class:`LeaseLost`) ends
the thread where it is, and the fall-back checks the lease before it writes a version's files (a file system has no
fence). The loss is kept and raised to the training loop by its next :meth:`Broadcaster.submit`, which stops there
with exit code 5 like any other refused write (its lease thread interrupts it within a third of the lease anyway).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from common.config import Config
from common.metrics import BroadcastFallback, LearnerMetrics
from common.ports import free_port
from common.schemas import NcclMember
from common.transport import LearnerTransport, LeaseLost
from common.weights.nccl import (
    Bucket,
    NcclRound,
    abort_group,
    assign_ranks,
    close_group,
    flatten,
    open_group,
    plan_buckets,
    unflatten,
    wait_for,
)

log = logging.getLogger(__name__)


class RoundFailed(Exception):
    def __init__(self, reason: BroadcastFallback | Literal["closing"], message: str):
        super().__init__(message)
        self.reason = reason


def learner_address(configured: str) -> str:
    """``weights.nccl_address``, or the address of this host's name (what a container's peers reach it at)."""
    if configured:
        return configured
    address = socket.gethostbyname(socket.gethostname())
    if address.startswith("127."):
        log.warning("the learner's hostname resolves to %s: only actors on this machine can join the update group; "
                    "set weights.nccl_address to an address they reach", address)  # fmt: skip
    return address


@dataclass(frozen=True)
class Snapshot:
    """A version as it is sent: SGLang's flattened buckets, already copied to CPU memory (one copy of the model:
    training goes on while they are broadcast)."""

    buckets: list[Bucket]
    flats: list[torch.Tensor]  # one uint8 tensor per bucket

    def tensors(self) -> dict[str, torch.Tensor]:
        """The named tensors, for a fall-back to disk: copies, since views into one bucket share its storage, and
        save_pretrained takes tensors that share storage for tied weights and keeps one."""
        views = (unflatten(f, b) for b, f in zip(self.buckets, self.flats, strict=True))
        return {n: t.clone() for v in views for n, t in v.items()}

    @property
    def nbytes(self) -> int:
        return sum(f.numel() for f in self.flats)


def snapshot(
    model: torch.nn.Module, state: dict[str, torch.Tensor] | None, dtype: str, bucket_bytes: int = 512 * 2**20
) -> Snapshot:
    """The tensors to send, in the model's order and in ``weights.dtype`` (``state``: a sharded learner's gathered
    copy), each copied once, into its bucket. A weight tied to an earlier one (the output layer to the embeddings) is
    left out, as save_pretrained leaves it out of the files: the server ties it itself."""
    seen: set[int] = set()
    tied: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.add(id(p))
    whole = state if state is not None else model.state_dict()
    cast = None if dtype == "model" else getattr(torch, dtype)
    named = {}
    for name, t in whole.items():
        if name in tied:
            continue
        t = t.detach()
        named[name] = t.to(cast) if cast is not None and t.is_floating_point() else t
    buckets = plan_buckets(named.items(), bucket_bytes)
    flats = [flatten([named[n] for n in b.names]) for b in buckets]
    return Snapshot(buckets, flats)


def send_buckets(pg: Any, snap: Snapshot, timeout_s: float, backend: str, device: str = "cuda") -> None:
    """Broadcast each bucket from rank 0 (from ``device``, this rank's GPU, for nccl); raises when one does not
    complete within ``timeout_s``."""
    import torch.distributed as dist

    for flat in snap.flats:
        if backend == "nccl":
            flat = flat.to(device, non_blocking=True)
        work = dist.broadcast(flat, group_src=0, group=pg, async_op=True)
        wait_for(work, timeout_s, f"a bucket of {flat.numel()} bytes did not go out")


@dataclass
class _Group:
    name: str
    members: dict[str, tuple[int, str]]  # member -> (ranks, process nonce) it was formed with
    ranks: dict[str, int]
    world_size: int
    port: int
    pg: Any = None


def _identity(members: dict[str, NcclMember]) -> dict[str, tuple[int, str]]:
    return {m: (d.ranks, d.nonce) for m, d in members.items()}


class Broadcaster:
    def __init__(
        self,
        cfg: Config,
        transport: LearnerTransport,
        metrics: LearnerMetrics,
        *,
        to_disk: Callable[[int, Snapshot], None],
        announce_nccl: Callable[[int, Snapshot, NcclRound], None],
        announced: Callable[[], int] = lambda: -1,
        device: str = "cpu",
    ):
        """``to_disk(version, snapshot)`` writes and announces a version (the fall-back); ``announce_nccl(version,
        snapshot, round)`` announces one the round's members received (they take it into service only then);
        ``announced()`` is the newest version announced (a round for an older one is skipped); ``device``: the
        learner's, where nccl buckets are staged."""
        self.cfg = cfg
        self.wc = cfg.weights
        self.transport = transport
        self.metrics = metrics
        self.to_disk = to_disk
        self.announce_nccl = announce_nccl
        self.announced = announced
        self.device = device
        self.address = learner_address(self.wc.nccl_address)
        self.group: _Group | None = None
        self.generation = 0
        self.session = uuid.uuid4().hex[:8]  # this learner's rounds and groups are never taken for an earlier one's
        self.seq = 0
        self.rounds_ok = 0
        self.fallbacks = 0
        self._pending: tuple[int, Snapshot] | None = None
        self._cv = threading.Condition()
        self._closing = False
        self.lost: LeaseLost | None = None  # another learner took the run over: this thread wrote nothing since
        self._thread = threading.Thread(target=self._run, name="weights-broadcast", daemon=True)
        self._thread.start()

    # -- the training loop's side -------------------------------------------------------------------------------

    def members(self) -> dict[str, NcclMember]:
        return self.transport.nccl_members(self.cfg.run.heartbeat_ttl_s)

    def submit(self, version: int, snap: Snapshot) -> None:
        """Hand ``version`` to the thread; :class:`LeaseLost` when the thread found the run lost (it stopped)."""
        if self.lost is not None:
            raise self.lost
        with self._cv:
            if self._pending is not None:
                self.metrics.broadcast_superseded.inc()
                log.info("weights v%d superseded by v%d before its broadcast", self._pending[0], version)
            self._pending = (version, snap)
            self._cv.notify_all()

    def close(self) -> None:
        """Drop what waits, cancel a round still waiting for its members, let a broadcast end (each of its waits is
        bounded), leave the group. A thread that does not end in time is left behind (a daemon)."""
        with self._cv:
            self._closing = True
            self._pending = None
            self._cv.notify_all()
        self._thread.join(timeout=2 * self.wc.nccl_timeout_s + 30)
        if self._thread.is_alive():
            log.warning("the weights broadcast thread did not stop; leaving it")
            return
        self._close_group()

    # -- the thread ---------------------------------------------------------------------------------------------

    def _run(self) -> None:
        if self.wc.nccl_backend == "nccl" and self.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(self.device))  # a new thread starts on cuda:0
        while True:
            with self._cv:
                while self._pending is None and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                assert self._pending is not None
                version, snap = self._pending
                self._pending = None
            try:
                self._publish(version, snap)  # a failed round falls back to disk
            except LeaseLost as e:  # never write again: the run is another learner's
                self._lose(version, e)
                return

    def _lose(self, version: int, e: LeaseLost) -> None:
        log.error("weights v%d: the broadcast thread stops, writing nothing more: %s", version, e)
        self._close_group(abort=True)
        with self._cv:
            self.lost = e
            self._pending = None

    def _publish(self, version: int, snap: Snapshot) -> None:
        if version <= self.announced():  # a newer version went to disk meanwhile: this one would be a step back
            log.info("weights v%d not broadcast: a newer version was announced", version)
            return
        t0 = time.perf_counter()
        try:
            nccl_round = self._round(version, snap)
        except LeaseLost:  # a fenced write of the round refused: nothing goes to disk either
            raise
        except Exception as e:  # whatever else failed (a member, the network, Redis), the version must still go out
            reason = e.reason if isinstance(e, RoundFailed) else "error"
            self._close_group(abort=reason in ("broadcast", "error"))
            if reason == "closing":  # the learner is stopping; its next start publishes to disk first
                log.info("weights v%d: broadcast abandoned, the learner is stopping", version)
                return
            self.fallbacks += 1
            self.metrics.broadcast_fallbacks.labels(reason).inc()
            log.warning("weights v%d go to disk: %s", version, e)
            try:
                self._still_holding()  # a file has no fence: a learner that lost the run writes no version's files
                self.to_disk(version, snap)
            except LeaseLost:
                raise
            except Exception:  # (Redis unreachable for the check too: the next version goes out)
                log.exception("weights v%d: writing them to disk failed too", version)
            return
        seconds = time.perf_counter() - t0
        self.rounds_ok += 1
        self.metrics.broadcast_seconds.observe(seconds)
        try:
            self.announce_nccl(version, snap, nccl_round)  # the members take it into service once they read this
        except LeaseLost:
            raise
        except Exception:  # the members drop what they received; the next version's announcement brings them on
            log.exception("weights v%d: announcing it failed", version)
        log.debug("weights v%d broadcast to %d members in %.3fs", version, len(self.group.ranks) if self.group else 0,
                  seconds)  # fmt: skip

    def _still_holding(self) -> None:
        """One round trip: :class:`LeaseLost` if another learner took the run over (a learner with a lease only)."""
        if self.transport.lease_token():
            self.transport.renew_lease()

    def _round(self, version: int, snap: Snapshot) -> NcclRound:
        members = self.members()
        if not members:
            raise RoundFailed("no_members", "no actor takes weights over NCCL")
        timeout = self.wc.nccl_timeout_s
        group = self.group
        # A new group when the members changed (or one restarted: a new nonce), or when one of them is not in the
        # group it was formed into (it left after a failure it saw and the learner did not).
        fresh = (
            group is None or group.members != _identity(members) or any(d.group != group.name for d in members.values())
        )
        if fresh:
            self._close_group()
            self.generation += 1
            ranks, world = assign_ranks({m: r for m, (r, _) in _identity(members).items()})
            port = self.wc.nccl_port or free_port()
            name = f"grpo-{self.cfg.run.name}-{self.session}-{self.generation}"
            group = self.group = _Group(name, _identity(members), ranks, world, port)
        assert group is not None
        self.seq += 1
        nccl_round = NcclRound(self.session, self.seq, version, group.name, self.address, group.port, group.world_size,
                    self.wc.nccl_backend, group.ranks, snap.buckets)  # fmt: skip
        self.transport.nccl_open_round(nccl_round)
        self._await_ready(nccl_round, group, timeout)
        if fresh:
            # Members join now; rank 0's store waits until all of them are connected, and only then does anyone
            # go on to a collective (NCCL forms its communicator there, and SGLang would wait in it for long).
            self.transport.nccl_decide(nccl_round.id, "join")
            try:
                group.pg = open_group(
                    address=self.address, port=group.port, world_size=group.world_size, rank=0,
                    group_name=group.name, backend=self.wc.nccl_backend, timeout_s=timeout,
                    collective_timeout_s=max(3600.0, 10 * timeout),
                )  # fmt: skip
            except Exception as e:
                self.transport.nccl_decide(nccl_round.id, "cancel")
                raise RoundFailed("join", f"the update group {group.name} did not form: {e}") from None
        self.transport.nccl_decide(nccl_round.id, "go")
        try:
            send_buckets(group.pg, snap, timeout, self.wc.nccl_backend, self.device)
        except Exception as e:
            raise RoundFailed("broadcast", f"broadcast to {group.name} failed: {e}") from None
        return nccl_round

    def _await_ready(self, nccl_round: NcclRound, group: _Group, timeout: float) -> None:
        """Nobody enters the group's rendezvous or a broadcast until every member said it is ready: a member that is
        slow or gone cancels the round before anyone is inside a collective that could not complete."""
        deadline = time.monotonic() + timeout
        while missing := set(group.ranks) - self.transport.nccl_ready_members(nccl_round.id):
            if self._closing:
                self.transport.nccl_decide(nccl_round.id, "cancel")
                raise RoundFailed("closing", "the learner is stopping")
            if time.monotonic() > deadline:
                self.transport.nccl_decide(nccl_round.id, "cancel")
                raise RoundFailed("not_ready", f"{sorted(missing)} not ready after {timeout:.0f}s")
            time.sleep(0.02)

    def _close_group(self, abort: bool = False) -> None:
        if self.group is not None and self.group.pg is not None:
            (abort_group if abort else close_group)(self.group.pg)
        self.group = None
