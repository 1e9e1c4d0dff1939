"""What a reader of the weight store (common.weights) may open, and the errors a version's reader raises: an
announcement is data from Redis, not a path to trust, so an announced directory must lie inside ``weights.dir`` and
only regular files are opened."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

from common.metrics import WeightLoadFailure


class WeightsError(RuntimeError):
    """A published version is missing, incomplete, or does not match its digest."""

    # The label it is counted under (grpo_actor_weight_load_failures_total{reason}).
    reason: WeightLoadFailure = "unreadable"


class WeightsMismatch(WeightsError):
    """A version whose tensors' names, shapes or dtypes do not fit the model being served."""

    reason = "mismatch"


class UnsafeWeightsPath(WeightsError):
    """An announced uri outside ``weights.dir`` (or leaving it through a symlink), or a file that is not a regular
    file: never opened, so a FIFO cannot block a reader and a symlink cannot make it read another file."""

    reason = "path"


def open_regular(path: Path, *, follow_symlinks: bool = False) -> Any:
    """``path`` opened for unbuffered reading, only when it is a regular file; UnsafeWeightsPath otherwise, without
    opening it where lstat already tells (a device node, a FIFO, a symlink). The open itself neither follows a
    symlink (O_NOFOLLOW) nor waits for a FIFO's writer (O_NONBLOCK), and what it opened is checked again (fstat), so
    a file swapped meanwhile cannot slip through. ``follow_symlinks``: for a model directory of the user's own (a
    Hugging Face cache links its files to blobs), never for a published version."""
    if not follow_symlinks and not stat.S_ISREG(os.lstat(path).st_mode):
        raise UnsafeWeightsPath(f"{path}: not a regular file (a symlink, FIFO or device): refused")
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeWeightsPath(f"{path}: a symlink: refused") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeWeightsPath(f"{path}: not a regular file: refused")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def confined(uri: str, root: str | os.PathLike[str]) -> Path:
    """The announced directory ``uri``, resolved (``..`` and every symlink followed), when it lies inside ``root``
    (``weights.dir``, resolved the same way); UnsafeWeightsPath otherwise. The learner writes every version there,
    so an announcement naming anything else (an absolute path elsewhere, ``../``, a symlink out of the directory)
    is refused before a byte is read."""
    try:
        base, target = Path(os.path.realpath(root)), Path(os.path.realpath(uri))
    except (ValueError, OSError) as e:  # a NUL byte, a symlink loop
        raise UnsafeWeightsPath(f"weights uri {uri[:200]!r}: {e}") from None
    if base not in target.parents:
        raise UnsafeWeightsPath(f"weights uri {uri[:200]!r} is outside weights.dir {str(base)!r}: refused")
    return target
