"""Publishing policy versions: ``gather the weights → write or broadcast → announce``, and versions that never go back.

Each version goes to the first of the publisher's sinks that takes it. :class:`DiskSink` (``weights.transport`` disk,
and the last resort of nccl) writes it to ``weights.dir`` and announces it in Redis. :class:`NcclSink` hands a CPU
snapshot to the broadcast thread (learner.nccl_weights), which announces it once its actors have it, or writes it to
disk when they could not take it; the versions every actor must be able to read from disk it leaves to the next.
Versions must never go back or name two different weights (actors and staleness rely on both), also across learner
crashes (see :meth:`Publisher.continue_versions` and learner.lineage).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import torch

from common.config import Config
from common.metrics import LearnerMetrics
from common.model.lora import is_lora
from common.schemas import SchemaError, WeightsAnnouncement
from common.storage import writing
from common.transport import LearnerTransport
from common.weights import newest_on_disk, publish, tensors_digest
from common.weights.adapters import base_identity
from common.weights.nccl import NcclRound, announcement_uri
from learner.distributed import Ranks
from learner.fencing import superseded_versions
from learner.nccl_weights import Broadcaster, Snapshot, snapshot
from learner.progress import Progress

log = logging.getLogger("learner")


def latest_announcement(transport: LearnerTransport) -> WeightsAnnouncement | None:
    try:
        return transport.latest_weights()
    except SchemaError as e:  # garbage in weights:latest: this learner's first announcement replaces it
        log.warning("ignoring weights:latest: %s", e)
        return None


def newest_published(cfg: Config, transport: LearnerTransport, announced: WeightsAnnouncement | None = None) -> int:
    """The highest version announced or left under ``weights.dir`` (-1: none); a version a learner wrote after
    another took the run over was never announced and does not count (learner.fencing)."""
    if announced is None:
        announced = latest_announcement(transport)
    on_disk = newest_on_disk(cfg.weights.dir, superseded_versions(cfg.checkpoint.dir))
    return max(-1 if announced is None else announced.version, on_disk)


class Publisher:
    def __init__(
        self,
        cfg: Config,
        transport: LearnerTransport,
        model: Any,
        tokenizer: Any,
        metrics: LearnerMetrics,
        ranks: Ranks | None,
    ):
        self.cfg = cfg
        self.transport = transport
        self.model = model
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.ranks = ranks
        self._publish_lock = threading.Lock()  # one writer: the broadcast thread may write a version to disk too
        self.announced_version = -1  # the newest version this learner announced
        self._last_announcement: WeightsAnnouncement | None = None  # announced again if Redis loses it
        self._epoch = 0  # the lineage's epoch of the version being published, which its announcement carries
        # learner.lora: the base model's identity, written beside each version (an adapter alone) for the actors to
        # check against the base they hold (common.model.lora); None: versions are whole weights.
        self.base = base_identity(cfg.model.path) if is_lora(model) else None
        if cfg.weights.transport == "nccl" and self.base is not None:
            # SGLang's update group carries a model's own weights, not an adapter; an adapter is small enough that
            # the disk costs little.
            log.info("learner.lora: versions are adapters, written to weights.dir and loaded from there (the NCCL "
                     "update group carries whole weights only)")  # fmt: skip
        nccl = cfg.weights.transport == "nccl" and self.base is None
        self.sinks: list[Sink] = [*([NcclSink(self)] if nccl else []), DiskSink(self._write)]

    def continue_versions(self, p: Progress) -> None:
        """A learner that crashed may have published weights of steps that no checkpoint has (or before its first
        checkpoint). The weights we start from (``p``'s) become the next version after every one announced or still
        on disk (a Redis that lost its data no longer says), and a new epoch of the lineage begins there
        (learner.lineage): ``p``'s version and lineage move on."""
        if self.ranks is None or self.ranks.is_rank0:
            announced = latest_announcement(self.transport)
            top = newest_published(self.cfg, self.transport, announced)
            if top > p.version:
                epoch = max(p.lineage.current.epoch, 0 if announced is None else announced.epoch) + 1
                log.info("version %d was published by an earlier learner after the state we start from: continuing "
                         "at version %d (epoch %d, from step %d)", top, top + 1, epoch, p.step)  # fmt: skip
                p.version = top + 1
                p.lineage.begin(epoch, p.step, p.version)
        if self.ranks is not None:
            p.version = int(self.ranks.broadcast(p.version))

    def publish(self, version: int, epoch: int, last: bool) -> dict[str, float]:
        """Rank 0 hands the current weights on as ``version`` (of the lineage's ``epoch``) and announces them; under
        torchrun every rank first helps gather them whole. With nccl, the first and ``last`` versions, every
        ``weights.disk_every``-th, and any version some live actor cannot take over NCCL are written to disk here."""
        whole = self.ranks.full_model_state(self.model) if self.ranks is not None else None
        if self.ranks is not None and not self.ranks.is_rank0:
            return {}
        t0 = time.perf_counter()
        self._epoch = epoch
        next(sink for sink in self.sinks if sink.take(version, whole, last))  # the disk takes every version
        counts = {k: v for sink in self.sinks for k, v in sink.counts().items()}
        return {"time/publish_s": time.perf_counter() - t0, **counts}

    def _write(self, version: int, state: dict[str, torch.Tensor] | None) -> None:
        """Write ``version`` to ``weights.dir`` and announce it, unless a newer one was announced meanwhile (the
        broadcast thread falls back late). One writer: the training loop and the broadcast thread both come here,
        and the lock covers the check, the write and the announcement, so their writes never overlap and the prune
        keeps the version announced until the next one is (the training loop may wait for a fall-back's write)."""
        wc = self.cfg.weights
        with self._publish_lock:
            if version < self.announced_version:
                return
            with writing(wc.dir):
                pub = publish(
                    self.model,
                    self.tokenizer,
                    wc.dir,
                    version,
                    wc.keep,
                    wc.dtype,
                    wc.digest,
                    prune_in_background=True,
                    state_dict=state,
                    protect=[self.announced_version],
                    token=self.transport.lease_token(),
                    superseded=superseded_versions(self.cfg.checkpoint.dir),
                    base=self.base,
                )
            self._announce(pub.announcement)
            self.announced_version = version
        self.metrics.publish_seconds.observe(pub.seconds)
        self.metrics.publish_bytes.set(pub.nbytes)

    def fall_back(self, version: int, snap: Snapshot) -> None:
        self._write(version, snap.tensors())

    def announce_nccl(self, version: int, snap: Snapshot, nccl_round: NcclRound) -> None:
        """Announce a version the members of round ``nccl_round`` received over NCCL (``format: nccl``, the ``uri``
        naming the round): they take it into service when they read this, a write behind the lease's fence, so a learner
        that lost the run after its broadcast never has its bytes served. The digest (of the bytes sent) names the
        contents."""
        checked, nbytes = tensors_digest(snap.flats, self.cfg.weights.digest)
        with self._publish_lock:
            if version <= self.announced_version:
                return
            self._announce(WeightsAnnouncement(version, announcement_uri(nccl_round), checked, format="nccl"))
            self.announced_version = version
        self.metrics.publish_bytes.set(nbytes)

    def _announce(self, ann: WeightsAnnouncement) -> None:
        """Announce with this lineage's epoch (actors stamp it on their groups), and keep it to announce again."""
        ann = replace(ann, epoch=self._epoch)
        self.transport.announce_weights(ann)
        self._last_announcement = ann

    def announce_again(self) -> None:
        """After Redis lost the run: actors holding the last version announced see a version that did not go back."""
        with self._publish_lock:  # the broadcast thread may be announcing a newer one: never announce over it
            if self._last_announcement is not None:
                self.transport.announce_weights(self._last_announcement)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class Sink(Protocol):
    def take(self, version: int, whole: dict[str, torch.Tensor] | None, last: bool) -> bool:
        """Send ``version`` on its way (``whole``: the tensors gathered from every rank, or None for the model's
        own); False when this sink leaves it to the next. ``last``: the run's last version."""
        ...

    def counts(self) -> dict[str, float]:
        """What it did so far, for the step's metrics row."""
        ...

    def close(self) -> None: ...


class DiskSink:
    """Every version, written to ``weights.dir`` and announced (:meth:`Publisher._write`)."""

    def __init__(self, write: Callable[[int, dict[str, torch.Tensor] | None], None]):
        self.write = write

    def take(self, version: int, whole: dict[str, torch.Tensor] | None, last: bool) -> bool:
        self.write(version, whole)
        return True

    def counts(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class NcclSink:
    """``weights.transport: nccl``: a CPU snapshot to the broadcast thread (started on the first version it takes),
    except the versions that must be on disk: the first and the last, every ``weights.disk_every``-th, and any that a
    live actor outside the update group could not take (it loads from disk only)."""

    def __init__(self, publisher: Publisher):
        self.p = publisher
        self.broadcaster: Broadcaster | None = None

    def take(self, version: int, whole: dict[str, torch.Tensor] | None, last: bool) -> bool:
        b, wc = self._broadcaster(), self.p.cfg.weights
        periodic = wc.disk_every > 0 and version % wc.disk_every == 0
        if self.p.announced_version < 0 or last or periodic or self._actors_without_nccl(b):
            return False
        b.submit(version, snapshot(self.p.model, whole, wc.dtype, int(wc.nccl_bucket_mb * 2**20)))
        return True

    def counts(self) -> dict[str, float]:
        if (b := self.broadcaster) is None:
            return {}
        return {"weights/nccl_rounds": float(b.rounds_ok), "weights/nccl_fallbacks": float(b.fallbacks)}

    def _broadcaster(self) -> Broadcaster:
        if self.broadcaster is None:
            p = self.p
            device = str(p.ranks.device) if p.ranks is not None else p.cfg.model.device
            self.broadcaster = Broadcaster(
                p.cfg, p.transport, p.metrics, to_disk=p.fall_back, announce_nccl=p.announce_nccl,
                announced=lambda: p.announced_version, device=device,
            )  # fmt: skip
        return self.broadcaster

    def _actors_without_nccl(self, b: Broadcaster) -> bool:
        """Whether a live actor is not a member of the update group (its engine loads from disk only)."""
        return bool(set(self.p.transport.live_actors()) - set(b.members()))

    def close(self) -> None:
        if self.broadcaster is not None:
            self.broadcaster.close()
            self.broadcaster = None
