"""The learner's side of ``weights.transport: nccl`` (the protocol: common/weight_sync.py).

A :class:`Broadcaster` thread on rank 0 takes each version the learner hands it (a CPU snapshot, so training goes on
meanwhile) and runs a round: it (re)forms the update group when the members changed or the last round failed, waits
until every member is ready, says ``go`` and broadcasts the buckets, then announces the version. When anything does
not happen within ``weights.nccl_timeout_s`` (a member never readies, the group never forms, a bucket never
completes) it says ``cancel``, writes the version to disk and announces that instead, and drops the group so that
the next round forms a fresh one. The training loop never waits on any of it: a version published while a round is
in flight replaces the one waiting for its turn (latest wins; counted as superseded).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from common.config import Config
from common.metrics import LearnerMetrics
from common.redis_server import free_port
from common.transport import Transport
from common.weight_sync import Bucket, Round, assign_ranks, close_group, flatten, open_group, plan_buckets

log = logging.getLogger(__name__)


class RoundFailed(Exception):
    def __init__(self, reason: str, message: str):
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


Tensors = list[tuple[str, torch.Tensor]]


def snapshot(model: torch.nn.Module, state: dict[str, torch.Tensor] | None, dtype: str) -> Tensors:
    """The tensors to send, in the model's order, as a CPU copy in ``weights.dtype`` (``state``: a sharded
    learner's gathered copy). A weight tied to an earlier one (the output layer to the embeddings) is left out, as
    save_pretrained leaves it out of the files: the server ties it itself."""
    seen: set[int] = set()
    tied: set[str] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.add(id(p))
    whole = state if state is not None else model.state_dict()
    cast = None if dtype == "model" else getattr(torch, dtype)
    out = []
    for name, t in whole.items():
        if name in tied:
            continue
        t = t.detach()
        if cast is not None and t.is_floating_point():
            t = t.to(cast)
        out.append((name, t.to("cpu", copy=True)))
    return out


@dataclass
class _Group:
    name: str
    members: dict[str, int]
    ranks: dict[str, int]
    world_size: int
    port: int
    pg: Any = None


class Broadcaster:
    def __init__(
        self,
        cfg: Config,
        transport: Transport,
        metrics: LearnerMetrics,
        *,
        to_disk: Callable[[int, Tensors], None],
        announce_nccl: Callable[[int, Tensors], None],
    ):
        """``to_disk(version, tensors)`` writes and announces a version (the fall-back); ``announce_nccl(version,
        tensors)`` announces one its members received."""
        self.cfg = cfg
        self.wc = cfg.weights
        self.transport = transport
        self.metrics = metrics
        self.to_disk = to_disk
        self.announce_nccl = announce_nccl
        self.address = learner_address(self.wc.nccl_address)
        self.group: _Group | None = None
        self.generation = 0
        self.session = uuid.uuid4().hex[:8]  # group names of this learner never match an earlier one's
        self.seq = 0
        self.rounds_ok = 0
        self.fallbacks = 0
        self._pending: tuple[int, Tensors] | None = None
        self._cv = threading.Condition()
        self._busy = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="weights-broadcast", daemon=True)
        self._thread.start()

    # -- the training loop's side -------------------------------------------------------------------------------

    def members(self) -> dict[str, int]:
        return self.transport.nccl_members(self.cfg.actor.heartbeat_ttl_s)

    def submit(self, version: int, tensors: Tensors) -> None:
        with self._cv:
            if self._pending is not None:
                self.metrics.broadcast_superseded.inc()
                log.info("weights v%d superseded by v%d before its broadcast", self._pending[0], version)
            self._pending = (version, tensors)
            self._cv.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no round is pending or running; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._pending is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self) -> None:
        """Drop what waits, let a running round end (each of its waits is bounded), leave the group."""
        with self._cv:
            self._closing = True
            self._pending = None
            self._cv.notify_all()
        self._thread.join()
        self._close_group()

    # -- the thread ---------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                assert self._pending is not None
                version, tensors = self._pending
                self._pending = None
                self._busy = True
            try:
                self._publish(version, tensors)
            except Exception:  # the thread must outlive anything a round throws: the next version tries again
                log.exception("weights v%d: the broadcast thread failed", version)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _publish(self, version: int, tensors: Tensors) -> None:
        t0 = time.perf_counter()
        try:
            self._round(version, tensors)
        except RoundFailed as e:
            if e.reason == "closing":  # the learner is stopping; its next start publishes to disk first
                log.info("weights v%d: broadcast abandoned, the learner is stopping", version)
                self._close_group()
                return
            self.fallbacks += 1
            self.metrics.broadcast_fallbacks.labels(e.reason).inc()
            log.warning("weights v%d go to disk: %s", version, e)
            self._close_group()
            self.to_disk(version, tensors)
            return
        seconds = time.perf_counter() - t0
        self.rounds_ok += 1
        self.metrics.broadcast_seconds.observe(seconds)
        self.announce_nccl(version, tensors)
        log.debug("weights v%d broadcast to %d members in %.3fs", version, len(self.group.ranks) if self.group else 0,
                  seconds)  # fmt: skip

    def _round(self, version: int, tensors: Tensors) -> None:
        members = self.members()
        if not members:
            raise RoundFailed("no_members", "no actor takes weights over NCCL")
        timeout = self.wc.nccl_timeout_s
        fresh = self.group is None or self.group.members != members
        if fresh:
            self._close_group()
            self.generation += 1
            ranks, world = assign_ranks(members)
            port = self.wc.nccl_port or free_port()
            name = f"grpo-{self.cfg.run.name}-{self.session}-{self.generation}"
            self.group = _Group(name, dict(members), ranks, world, port)
        group = self.group
        assert group is not None
        buckets = plan_buckets(tensors, int(self.wc.nccl_bucket_mb * 2**20))
        self.seq += 1
        seq = self.seq
        rnd = Round(seq, version, group.name, self.address, group.port, group.world_size, self.wc.nccl_backend,
                    group.ranks, buckets)  # fmt: skip
        self.transport.nccl_open_round(rnd.to_json(), seq)
        # Nobody enters the group's rendezvous or a broadcast until every member said it is ready: a member that is
        # slow or gone cancels the round before anyone is inside a collective that could not complete.
        deadline = time.monotonic() + timeout
        while True:
            missing = set(group.ranks) - self.transport.nccl_ready_members(seq)
            if not missing:
                break
            if self._closing:
                self.transport.nccl_decide(seq, "cancel")
                raise RoundFailed("closing", "the learner is stopping")
            if time.monotonic() > deadline:
                self.transport.nccl_decide(seq, "cancel")
                raise RoundFailed("not_ready", f"{sorted(missing)} not ready after {timeout:.0f}s")
            time.sleep(0.02)
        self.transport.nccl_decide(seq, "go")
        if fresh:
            try:
                group.pg = open_group(
                    address=self.address, port=group.port, world_size=group.world_size, rank=0,
                    group_name=group.name, backend=self.wc.nccl_backend, timeout_s=timeout,
                )  # fmt: skip
            except Exception as e:
                raise RoundFailed("join", f"the update group {group.name} did not form: {e}") from None
        try:
            self._send(group.pg, buckets, tensors, timeout)
        except Exception as e:
            raise RoundFailed("broadcast", f"broadcast to {group.name} failed: {e}") from None

    def _send(self, pg: Any, buckets: list[Bucket], tensors: Tensors, timeout_s: float) -> None:
        import datetime

        import torch.distributed as dist

        by_name = dict(tensors)
        device = torch.device("cuda", torch.cuda.current_device()) if self.wc.nccl_backend == "nccl" else None
        for bucket in buckets:
            flat = flatten([by_name[n] for n in bucket.names])
            if device is not None:
                flat = flat.to(device, non_blocking=True)
            work = dist.broadcast(flat, group_src=0, group=pg, async_op=True)
            if not work.wait(timeout=datetime.timedelta(seconds=timeout_s)):
                raise TimeoutError(f"a bucket of {flat.numel()} bytes did not go out in {timeout_s:.0f}s")

    def _close_group(self) -> None:
        if self.group is not None and self.group.pg is not None:
            close_group(self.group.pg)
        self.group = None
