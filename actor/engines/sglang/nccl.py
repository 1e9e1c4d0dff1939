"""The SGLang engine's side of ``weights.transport: nccl``: SGLang's own update-group calls
(``/init_weights_update_group``, ``/update_weights_from_distributed`` with flattened buckets between
``/begin_weight_update`` and ``/end_weight_update``, ``/destroy_weights_update_group``), each a step of a collective,
never retried. The weights a server takes stay unannounced (version -1, no sampling; actor.engines.sglang.unannounced)
until the actor commits them or discards them (actor.weights.nccl)."""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from actor.engines.base import EngineError
from actor.engines.sglang.client import SGLangClient
from actor.engines.sglang.unannounced import Unannounced
from common.schemas import NcclRound
from common.weights import WeightsError

log = logging.getLogger(__name__)


class NcclUpdates:
    """What :class:`actor.engines.sglang.engine.SGLangEngine` does with update groups (it is one of these)."""

    client: SGLangClient
    unannounced: Unannounced
    version: int
    served: str
    _received: str | None = None  # the round whose weights the server took, unannounced yet

    def _drop_adapter(self) -> None:
        raise NotImplementedError

    def _update_call(self, path: str, body: dict[str, Any], timeout_s: float) -> None:
        """A weight-update call: never retried (each one is a step of a collective), bounded by ``timeout_s``."""
        reply = self.client.request("POST", path, body, ok_statuses=(400,), timeout_s=timeout_s, retries=0)
        if not isinstance(reply, dict) or not reply.get("success"):
            message = reply.get("message") if isinstance(reply, dict) else reply
            raise EngineError(f"{path}: the SGLang server refused: {message}")

    def _unless_stuck(self, what: str, error: EngineError) -> NoReturn:
        """A server that still answers after a failed update-group call goes on serving (WeightsError: the version
        comes from disk); one stuck inside a rendezvous or a collective does not come back by itself (SGLang's group
        timeout is half an hour): EngineError, and the actor exits so that its restart policy replaces both."""
        if not self.client.healthy():
            raise EngineError(f"the SGLang server stopped answering after {what}: {error}") from None
        raise WeightsError(f"{what}: {error}") from None

    def join_group(self, nccl_round: NcclRound, rank_offset: int, timeout_s: float) -> None:
        r = nccl_round
        body = {"master_address": r.address, "master_port": r.port, "rank_offset": rank_offset,
                "world_size": r.world_size, "group_name": r.group, "backend": r.backend}  # fmt: skip
        try:
            self._update_call("/init_weights_update_group", body, timeout_s)
        except EngineError as e:
            self._unless_stuck(f"joining update group {nccl_round.group}", e)

    def leave_group(self, group: str) -> None:
        try:
            self._update_call("/destroy_weights_update_group", {"group_name": group}, 30.0)
        except EngineError as e:
            log.debug("leaving update group %s: %s", group, e)

    def receive(self, nccl_round: NcclRound, timeout_s: float) -> int:
        """One weight-update session: each bucket as SGLang's ``flattened_bucket``, the version and a cache flush with
        the last one. Taken once the requests on their way are answered, and none is sent until the decision
        (actor.engines.sglang.unannounced), so no generation sees half a version. The server loads each bucket as it
        comes, so from the first one on it holds weights nobody announced yet: the engine's version is -1, and the
        actor samples nothing, until :meth:`commit`. Raises :class:`WeightsError` when the server refused or failed
        and still answers, :class:`EngineError` when not."""
        updated = False
        if not self.unannounced.receiving(str(nccl_round.version), timeout_s):
            raise WeightsError(f"weights v{nccl_round.version} over NCCL: requests sent before were not answered "
                               f"within {timeout_s:.0f}s")  # fmt: skip
        try:
            self._update_call("/begin_weight_update", {}, timeout_s)
            try:
                for i, b in enumerate(nccl_round.buckets):
                    last = i == len(nccl_round.buckets) - 1
                    body: dict[str, Any] = {"names": b.names, "dtypes": b.dtypes, "shapes": b.shapes,
                                            "group_name": nccl_round.group, "load_format": "flattened_bucket",
                                            "flush_cache": last, "abort_all_requests": False}  # fmt: skip
                    if last:
                        body["weight_version"] = str(nccl_round.version)
                    updated, self.version = True, -1
                    self._update_call("/update_weights_from_distributed", body, timeout_s)
            finally:
                self._update_call("/end_weight_update", {}, timeout_s)
        except EngineError as e:
            self.unannounced.dropped(*([self.served] if updated else []))  # a mix, under the name it had
            if updated:  # SGLang loads each bucket as it comes: the server holds a mix of two versions now
                log.warning(
                    "weights v%d arrived in part: no sampling until a whole version is loaded", nccl_round.version
                )
            self._unless_stuck(f"weights v{nccl_round.version} over NCCL", e)
        except BaseException:  # (a reply cut short, say): requests waiting for the decision must not wait on
            self.unannounced.dropped(*([self.served] if updated else []))
            raise
        self._received = nccl_round.id
        return sum(b.nbytes for b in nccl_round.buckets)

    def commit(self, nccl_round: NcclRound) -> None:
        """The round was announced: the weights the server took are this version."""
        if self._received != nccl_round.id:
            self.unannounced.dropped()
            raise WeightsError(f"weights v{nccl_round.version} of round {nccl_round.id} were not received")
        self._received = None
        self.version = nccl_round.version
        self.served = str(nccl_round.version)
        self.unannounced.announced()
        self._drop_adapter()

    def discard(self, nccl_round: NcclRound) -> None:
        """Never announced: the server holds weights nobody announced (version -1, no sampling) until a whole
        announced version is loaded, as after a version that arrived in part. A reply those weights gave (a
        request sent meanwhile from a round in flight, or an episode's next turn) is refused
        (actor.engines.sglang.unannounced)."""
        self._received = None
        self.version = -1
        self.unannounced.dropped()
        log.warning("the SGLang server holds weights v%d of round %s, which were never announced: no sampling until "
                    "an announced version is loaded", nccl_round.version, nccl_round.id)  # fmt: skip
