"""Files a learner that lost the run may still write, and how every other learner ignores them.

Redis refuses each write of a learner that lost its lease (common.transport.lease), but a file system has no such
fence: a learner frozen past its lease may wake up and write a checkpoint, or a weights version, before it learns
that another learner took the run over. So each holder, once it holds the lease and before it writes anything else,
leaves a marker in ``<checkpoint.dir>/holders/``: its token, and the newest checkpoint step and weights version it
found there (``base_step``, ``base_version``). Checkpoints (``state.json`` field ``lease_token``) and versions (file
``lease_token``) carry the token of the learner that wrote them.

A file of token t at step (or version) n was written after a newer holder took over when a marker of a token above t
has a base below n: the resume path and the pruners ignore it (the pruners remove it), and no learner replaces or
prunes a file of a token above its own. A successor after a kill -9 resumes from its predecessor's checkpoints as
before: they are at or below its base.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from common.storage import fsync_dir, writing

log = logging.getLogger("learner")

# (token, step or version) -> whether a newer holder's marker says it was written after that holder took over.
Superseded = Callable[[int, int], bool]


@dataclass(frozen=True)
class Marker:
    token: int
    base_step: int  # the newest checkpoint step this holder found (0: none)
    base_version: int  # the newest weights version it found, announced or on disk (-1: none)
    host: str = ""
    pid: int = 0


def holders_dir(checkpoint_dir: str | os.PathLike[str]) -> Path:
    return Path(checkpoint_dir) / "holders"


def markers(checkpoint_dir: str | os.PathLike[str]) -> list[Marker]:
    """Every holder's marker; one that cannot be read is skipped with a line (each is written whole by a rename)."""
    root = holders_dir(checkpoint_dir)
    found: list[Marker] = []
    for f in sorted(root.glob("t*.json")) if root.is_dir() else []:
        try:
            d = json.loads(f.read_text())
            found.append(Marker(int(d["token"]), int(d["base_step"]), int(d["base_version"]),
                                str(d.get("host", "")), int(d.get("pid", 0))))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring the holder marker %s: %s", f, e)
    return found


def floor(checkpoint_dir: str | os.PathLike[str]) -> int:
    """The highest token a holder of this run has had (0: none): a new holder's is above it, even after Redis lost
    the token counter."""
    return max((m.token for m in markers(checkpoint_dir)), default=0)


def write_marker(checkpoint_dir: str | os.PathLike[str], marker: Marker) -> Path:
    """Leave this holder's marker, synced and renamed into place before the learner writes anything else."""
    root = holders_dir(checkpoint_dir)
    with writing(root):
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"t{marker.token:09d}.json"
        tmp = root / f".tmp-{final.name}"
        with tmp.open("w") as fh:
            json.dump(asdict(marker), fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        fsync_dir(root)
    return final


def superseded_steps(checkpoint_dir: str | os.PathLike[str]) -> Superseded:
    """Whether a checkpoint of (token, step) was written after a newer holder took over (the markers read once)."""
    return _judge([(m.token, m.base_step) for m in markers(checkpoint_dir)])


def superseded_versions(checkpoint_dir: str | os.PathLike[str]) -> Superseded:
    """Whether a weights version of (token, version) was written after a newer holder took over."""
    return _judge([(m.token, m.base_version) for m in markers(checkpoint_dir)])


def _judge(bases: list[tuple[int, int]]) -> Superseded:
    def superseded(token: int, n: int) -> bool:
        return any(t > token and n > base for t, base in bases)

    return superseded
