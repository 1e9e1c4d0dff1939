"""A published version read back: the digest of its files (``weights.digest``), checked before anything is used
(:func:`verify` for an engine that loads the files itself, :func:`load_state_dict` for one that takes tensors), each
file read once into one buffer so that what was hashed is what is loaded. The writer's side is common.weights.store.

The digest covers every ``*.safetensors`` file in name order. It is ``xxh3-128`` by default: what it guards against
is a torn, truncated, pruned or rewritten file on the shared volume, which a 128-bit hash catches, at about 15 times
sha256's speed (benchmark B4: sha256 over both sides cost four times a plain save and load). ``sha256`` is there for
whoever wants a cryptographic digest of what was served; someone able to write the weights volume could rewrite the
announcement too.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from common.schemas import DIGEST_HEX_LENGTHS, WeightsAnnouncement
from common.weights.files import WeightsError, confined, open_regular
from common.weights.format import buffer_tensors


def digest(
    directory: str | os.PathLike[str], algorithm: str = "xxh3-128", *, published: bool = True
) -> tuple[str, int]:
    """``"<algorithm>:<hex>"`` over every ``*.safetensors`` file in name order, and their total size in bytes.
    ``published``: a version of the store (regular files only); False for a model directory of the user's, whose
    files may be symlinks (a Hugging Face cache)."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{directory}: no *.safetensors files")
    h = _hasher(algorithm)
    total = sum(_hash_file(h, f, follow_symlinks=not published) for f in files)
    return f"{algorithm}:{h.hexdigest()}", total


def _hash_file(h: Any, path: Path, *, follow_symlinks: bool = False) -> int:
    """Stream one file into ``h`` without holding it in memory (a mapping on a local filesystem, 16 MiB reads on a
    network one: see _contents); returns its size. Verifying a version an engine loads itself needs no buffer."""
    with open_regular(path, follow_symlinks=follow_symlinks) as fh:
        if _mapped(path) and os.fstat(fh.fileno()).st_size:
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
                h.update(m)
                return len(m)
        chunk, total = memoryview(bytearray(1 << 24)), 0
        while n := fh.readinto(chunk):  # type: ignore[attr-defined]
            h.update(chunk[:n])
            total += n
        return total


# Filesystems where another host can delete a file under this one's feet (NFS, SMB, CephFS, Lustre, FUSE mounts
# such as object-store adapters): there a memory mapping of a deleted file kills the reader with SIGBUS.
_NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "lustre", "glusterfs", "9p", "afs", "beegfs", "gpfs")


def mount_type(path: str | os.PathLike[str], mounts: str | None = None) -> str:
    """The filesystem type of the mount holding ``path`` (Linux's /proc/self/mounts; "" where unknown)."""
    try:
        text = mounts if mounts is not None else Path("/proc/self/mounts").read_text()
    except OSError:
        return ""
    target, best, kind = os.path.realpath(path), -1, ""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, kind = len(point), fields[2]
    return kind


def _mapped(path: Path) -> bool:
    kind = mount_type(path)
    return bool(kind) and not (kind in _NETWORK_FS or kind.startswith("fuse"))


def _contents(path: Path) -> Any:
    """A whole file as one buffer, read once: the digest is computed over it and the tensors view it, so what was
    verified is what is loaded. On a local filesystem a private memory mapping (no copy: the page cache is read in
    place; the store never writes a file in place, and a version pruned meanwhile keeps its pages while mapped); on
    a network one, or where the type is unknown, a plain read into memory, which fails cleanly where a mapping of a
    file another host deleted would end the process."""
    with open_regular(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            raise WeightsError(f"{path}: empty file")
        if _mapped(path):
            return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        buf: Any = np.empty(size, dtype=np.uint8)  # not zero-filled first: every byte is read into it
        view, got = memoryview(buf), 0
        while got < size and (n := fh.readinto(view[got:])):  # type: ignore[attr-defined]
            got += n
    if got != size:
        raise WeightsError(f"{path}: {got} of {size} bytes read (the file changed while being read)")
    return buf


def _published_dir(ann: WeightsAnnouncement, root: str | os.PathLike[str] | None) -> Path:
    """Where to read ``ann`` from: confined to ``root`` (what actors pass: ``weights.dir``), or as announced."""
    return Path(ann.uri) if root is None else confined(ann.uri, root)


def _hasher(algorithm: str) -> Any:
    if algorithm == "xxh3-128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise WeightsError(f"unknown digest {algorithm!r} (this build knows {sorted(DIGEST_HEX_LENGTHS)})")


def tensors_digest(tensors: Iterable[torch.Tensor], algorithm: str = "xxh3-128") -> tuple[str, int]:
    """The digest of the tensors' bytes, one after the other (what weights.transport nccl sends), and their size."""
    h = _hasher(algorithm)
    nbytes = 0
    for t in tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        h.update(raw.numpy())
        nbytes += raw.numel()
    return f"{algorithm}:{h.hexdigest()}", nbytes


def _digest(buffers: list[Any], algorithm: str) -> str:
    h = _hasher(algorithm)
    for b in buffers:
        h.update(b)  # both release the GIL over large buffers
    return f"{algorithm}:{h.hexdigest()}"


def load_state_dict(
    ann: WeightsAnnouncement, *, root: str | os.PathLike[str] | None = None
) -> tuple[dict[str, torch.Tensor], int]:
    """Read a published version, checking its digest. Returns the tensors and the bytes read. ``root``: the weights
    directory the version must lie in (actors pass ``weights.dir``; see :func:`confined`).

    Each file is read once into one buffer (see _contents), and the very bytes that were hashed are the ones the
    tensors view (loading them into a model is then the one copy), so a version pruned or rewritten meanwhile is a
    WeightsError or the old, verified contents, never a half-verified load."""
    directory = _published_dir(ann, root)
    try:
        buffers = [_contents(f) for f in sorted(directory.glob("*.safetensors"))]
    except OSError as e:
        raise WeightsError(f"weights v{ann.version}: {e}") from None
    if not buffers:
        raise WeightsError(f"weights v{ann.version}: {directory} does not exist or holds no weights (pruned?)")
    _check_digest(ann, _digest(buffers, ann.digest_algorithm))
    state: dict[str, torch.Tensor] = {}
    for b in buffers:
        state.update(buffer_tensors(b, f"weights v{ann.version}"))
    return state, sum(len(b) for b in buffers)


def verify(ann: WeightsAnnouncement, *, root: str | os.PathLike[str] | None = None) -> int:
    """Check a published version's files against its announced digest without loading them (for an engine that
    loads them itself, such as a SGLang server); returns their size in bytes. A missing, pruned or altered version
    is a WeightsError; ``root`` as for :func:`load_state_dict`."""
    try:
        checked, nbytes = digest(_published_dir(ann, root), ann.digest_algorithm)
    except (OSError, ValueError) as e:
        raise WeightsError(f"weights v{ann.version}: {e}") from None
    _check_digest(ann, checked)
    return nbytes


def _check_digest(ann: WeightsAnnouncement, checked: str) -> None:
    if checked != ann.digest:
        raise WeightsError(
            f"weights v{ann.version}: digest {checked[:24]}… does not match announced {ann.digest[:24]}…"
        )
