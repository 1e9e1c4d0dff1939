"""Writing the run's files so that a crash, a power loss or a full disk loses nothing the rest of the run relies on.

- :func:`fsync_tree` and :func:`fsync_dir`: a file renamed into place survives a power loss only when its contents
  were on disk before the rename and the directory entry after it; the learner acknowledges groups in Redis (and
  deletes them from the stream) right after its checkpoint is renamed, so both are synced before it does.
- :func:`open_to_umask`: safetensors writes its files readable by their owner alone (mode 0600, whatever the umask);
  a model or a published version that another user reads (an image's user reading a mounted model, an SGLang server
  of its own user reading the weights) needs the mode any other file would get.
- :class:`StorageError`: a directory the run writes to that cannot take a write (read-only, full, over a file-size
  limit, not a directory). That is the machine's or the user's to fix, not a bug: ``grpo`` prints one line naming
  the path and the error and exits 2 (common/cli.py).
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# What a filesystem says when it cannot take a write: read-only, no permission, full, over quota, over the process's
# file-size limit, or a file where a directory should be.
STORAGE_ERRNOS = frozenset(
    {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.ENOTDIR, errno.EISDIR}
)
# safetensors reports I/O failures as its own exception with the OS error's number in the text.
_SAFETENSORS_OS_ERROR = re.compile(r"\(os error (\d+)\)")


class StorageError(Exception):
    """A path of the run cannot be written (see the module's docstring); the message is one line."""

    def __init__(self, path: str | os.PathLike[str], reason: str):
        super().__init__(f"cannot write {path}: {reason}")
        self.path = Path(path)


def storage_errno(e: BaseException) -> int | None:
    """The filesystem error number behind ``e`` when it is one of :data:`STORAGE_ERRNOS`, else None."""
    if isinstance(e, OSError):
        number = e.errno
    elif type(e).__name__ == "SafetensorError" and (m := _SAFETENSORS_OS_ERROR.search(str(e))):
        number = int(m.group(1))
    else:
        return None
    return number if number in STORAGE_ERRNOS else None


@contextmanager
def writing(path: str | os.PathLike[str]) -> Iterator[None]:
    """Turn a filesystem's refusal while writing under ``path`` into a :class:`StorageError` naming it (the file the
    error names, when it names one); any other error passes through unchanged."""
    try:
        yield
    except StorageError:
        raise
    except Exception as e:
        number = storage_errno(e)
        if number is None:
            raise
        where = getattr(e, "filename", None) or path
        raise StorageError(where, os.strerror(number)) from e


def fsync_file(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the directory's entries (a file created, renamed or removed in it) durable."""
    fsync_file(path)  # O_RDONLY on a directory is allowed on POSIX, and fsync on it syncs its entries


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """Every file under ``root``, then every directory under it (deepest first), then ``root`` itself."""
    dirs = []
    for here, subdirs, files in os.walk(root):
        for name in files:
            fsync_file(os.path.join(here, name))
        dirs += [os.path.join(here, d) for d in subdirs]
    for d in reversed(dirs):
        fsync_dir(d)
    fsync_dir(root)


def current_umask() -> int:
    """This process's umask, read without changing it (Linux's /proc; elsewhere the usual 022)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def open_to_umask(root: str | os.PathLike[str]) -> None:
    """Give every file under ``root`` the mode a plain ``open()`` would have given it (0666 less the umask), and every
    directory 0777 less the umask: what safetensors made owner-only becomes as readable as the rest of the folder."""
    mask = current_umask()
    for here, subdirs, files in os.walk(root):
        for name in files:
            os.chmod(os.path.join(here, name), 0o666 & ~mask)
        for name in subdirs:
            os.chmod(os.path.join(here, name), 0o777 & ~mask)
    os.chmod(root, 0o777 & ~mask)
