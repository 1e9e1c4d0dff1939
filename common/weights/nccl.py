"""Weights over NCCL (``weights.transport: nccl``): what the learner and its actors agree on.

The learner is rank 0 of an *update group*; the ranks of its actors' SGLang servers follow (a server with tensor
parallelism TP takes TP consecutive ranks from its ``rank_offset``). The group is SGLang's own protocol: each server
joins it with ``POST /init_weights_update_group`` (a ``tcp://`` rendezvous on the learner's address, a store prefixed
with the group's name, then a process group of that name: the same steps on both sides), then every version is sent
as buckets. A bucket is SGLang's ``flattened_bucket``: the bytes of its tensors, each flattened, concatenated in
order, broadcast from rank 0 as one uint8 tensor while each server, inside ``/begin_weight_update`` …
``/end_weight_update``, has asked for it with ``POST /update_weights_from_distributed`` (names, dtypes, shapes).

Learner and actors meet through Redis (``nccl:*`` keys, common.transport): actors that can take weights this way
register as *members* (with the group they are in); for each version the learner writes a :class:`NcclRound` (its
session and sequence number, the group, its ranks and the buckets) and waits until every member of the round said it
is ready. Then it says ``cancel`` (someone was not ready in time: the version goes to disk), or, for a new group,
``join`` (its rendezvous listens; members check they reach it and join; the learner waits until all are connected)
and then ``go`` (it broadcasts). Nobody enters the group's rendezvous or a broadcast before every member is known to
be there: a slow or dead actor costs a cancelled round, not a collective that cannot complete (only a member that
dies between its "ready" and the end of the broadcast leaves the others to time out).

The payload is fenced too, not only the decision: once its broadcast is complete the learner announces the version
in ``weights:latest`` (``format: nccl``, ``uri`` :func:`announcement_uri`, naming the round), a write behind its
lease's fence, and a member takes the buckets it received into service only when it reads that announcement. A
learner that lost the run after its "go" (frozen, cut off) may still deliver its bytes, but Redis refuses its
announcement: the members drop what they received (the local engine never applied it; a SGLang server, which loads
the buckets as they arrive, serves nothing until a whole announced version is loaded).

Pure pieces (bucket plans, flattening) are tested on their own, and the round's wire form (:class:`NcclRound`,
:class:`Bucket`) with the wire package (common.schemas); :func:`open_group` is the one place that touches
torch.distributed.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import torch

# The round and its buckets travel between processes: their forms are the wire package's (imported from here too).
from common.schemas import DTYPES, Bucket, NcclRound

__all__ = ["DTYPES", "Bucket", "NcclRound", "abort_group", "announcement_uri", "assign_ranks", "close_group",
"dtype_name",
           "flatten", "open_group", "plan_buckets", "unflatten", "wait_for"]  # fmt: skip


def announcement_uri(nccl_round: NcclRound) -> str:
    """The ``uri`` of the announcement of a version sent in round ``nccl_round``:
    ``nccl://<address>/<group>/<round id>``. A member takes what it received into service only when
    ``weights:latest`` names exactly this round (the round id carries the learner's session, so a successor's
    announcement of the same version number never matches)."""
    return f"nccl://{nccl_round.address}/{nccl_round.group}/{nccl_round.id}"


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"tensors of dtype {dtype} cannot be sent to SGLang")
    return name


def plan_buckets(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[Bucket]:
    """Consecutive tensors grouped into buckets of at most ``bucket_bytes`` (a larger tensor goes alone), in order;
    a tensor whose offset would not be a multiple of its element size starts a new bucket."""
    buckets: list[Bucket] = []
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[list[int]] = []
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        # SGLang reads each tensor as a view at its byte offset, which must be a multiple of its element size.
        if names and (size + nbytes > bucket_bytes or size % t.element_size()):
            buckets.append(Bucket(names, dtypes, shapes))
            names, dtypes, shapes, size = [], [], [], 0
        names.append(name)
        dtypes.append(dtype_name(t.dtype))
        shapes.append(list(t.shape))
        size += nbytes
    if names:
        buckets.append(Bucket(names, dtypes, shapes))
    return buckets


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The bytes of ``tensors``, one after the other, in one new uint8 tensor in CPU memory: SGLang's flattened
    bucket. Each tensor is copied once, straight into its place (from a GPU too: one device-to-host copy each)."""
    raws = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    flat = torch.empty(sum(r.numel() for r in raws), dtype=torch.uint8)
    at = 0
    for raw in raws:
        flat[at : at + raw.numel()].copy_(raw)
        at += raw.numel()
    return flat


def unflatten(flat: torch.Tensor, bucket: Bucket) -> dict[str, torch.Tensor]:
    """The tensors of ``bucket`` read back from its flattened bytes (views into ``flat``)."""
    out: dict[str, torch.Tensor] = {}
    at = 0
    for name, d, shape, n in zip(bucket.names, bucket.dtypes, bucket.shapes, bucket.sizes(), strict=True):
        out[name] = flat[at : at + n].view(getattr(torch, d)).reshape(shape)
        at += n
    if at != flat.numel():
        raise ValueError(f"a bucket of {flat.numel()} bytes holds {at} bytes of tensors")
    return out


def assign_ranks(members: Mapping[str, int]) -> tuple[dict[str, int], int]:
    """Rank offsets of the members (id -> how many ranks its server has), in id order after the learner's rank 0,
    and the group's world size."""
    offsets: dict[str, int] = {}
    at = 1
    for member in sorted(members):
        offsets[member] = at
        at += max(1, int(members[member]))
    return offsets, at


def open_group(
    *,
    address: str,
    port: int,
    world_size: int,
    rank: int,
    group_name: str,
    backend: str,
    timeout_s: float,
    collective_timeout_s: float | None = None,
) -> Any:
    """Join the update group as SGLang's servers join it (``init_weights_update_group``): a TCP store (rank 0 hosts
    it), prefixed with the group's name, a process group of that name. Rank 0 returns once all ``world_size`` ranks
    have connected to its store, or raises after ``timeout_s`` (NCCL's communicator itself is only formed by the
    first collective, so this is the check that everyone is in). ``collective_timeout_s``
    bounds each collective inside torch; the callers wait less than that themselves (NCCL's watchdog ends a process
    whose collective outlives it), and abort the group when their own wait runs out.

    This uses ``torch.distributed``'s private ``_new_process_group_helper``, as SGLang itself does: a group outside
    the default one (the learner may run under torchrun with its own), made of processes that never shared one."""
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    # The store a ``tcp://`` rendezvous makes, built here so that rank 0 hosts it even under torchrun (whose
    # rendezvous hands every rank its agent's store instead); rank 0's waits until every rank has connected.
    if rank == 0:
        store = _hosted_store(address, port, world_size, timeout)
    else:
        store = torch.distributed.TCPStore(address, port, world_size, False, timeout=timeout)
    prefixed = c10d.PrefixStore(group_name, store)
    collective = datetime.timedelta(seconds=collective_timeout_s or timeout_s)
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), prefixed, group_name=cast(Any, group_name), timeout=collective
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _hosted_store(address: str, port: int, world_size: int, timeout: datetime.timedelta) -> Any:
    """Rank 0's store, listening on ``address`` alone: TCPStore's own socket listens on every interface, so a
    learner told 127.0.0.1 (or one network's address) would take connections from any network. The socket is
    bound here and handed over; the store closes it when it is destroyed."""
    family, kind, proto, _, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(max(128, world_size))
    except BaseException:
        sock.close()
        raise
    inode, fd = os.fstat(sock.fileno()).st_ino, sock.detach()
    try:
        return torch.distributed.TCPStore(address, port, world_size, True, timeout=timeout, master_listen_fd=fd)
    except BaseException:
        with contextlib.suppress(OSError):  # unless the store closed it already (and the number was reused)
            if os.fstat(fd).st_ino == inode:
                os.close(fd)
        raise


def abort_group(pg: Any) -> None:
    """End a group whose collective did not complete: NCCL's communicators are aborted (a destroy would wait on
    them), gloo's sockets closed."""
    from torch.distributed import distributed_c10d as c10d

    abort = getattr(c10d, "_abort_process_group", None)
    with contextlib.suppress(Exception):
        if abort is not None:
            abort(pg)
            return
    close_group(pg)


def wait_for(work: Any, timeout_s: float, what: str) -> None:
    """Wait for a collective's ``work``; TimeoutError when it does not complete within ``timeout_s`` (gloo raises,
    NCCL returns False)."""
    try:
        done = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise TimeoutError(f"{what}: {e}") from None
    if done is False:
        raise TimeoutError(f"{what}: not complete in {timeout_s:.0f}s")


def close_group(pg: Any) -> None:
    import torch.distributed as dist

    with contextlib.suppress(Exception):  # a broken group may refuse to be destroyed cleanly; it is dropped anyway
        dist.destroy_process_group(pg)
