"""The weight store: one HF-format safetensors directory per policy version, on a volume learner and actors share.

Layout: ``<weights.dir>/v000012/`` holds ``config.json``, ``model.safetensors`` (or shards), tokenizer files (or,
with ``learner.lora``, the adapter alone: ``adapter_config.json``, ``adapter_model.safetensors`` and ``base.json``,
see common.weights.adapters), and ``digest`` (the digest announced in ``weights:latest``) and ``lease_token`` (the
token of the learner that wrote it: learner.fencing). A version is written under a temporary name, synced and
renamed into place, so a reader sees either nothing or the whole directory; the newest ``keep`` versions stay, and
the announced one whatever its number.

Actors read only what lies inside ``weights.dir`` (the announced ``uri`` resolved, symlinks included) and open only
regular files: an announcement is data from Redis, not a path to trust. How a version is read back and checked
against its digest: common.weights.reading.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.model.lora import adapter_state
from common.schemas import WeightsAnnouncement
from common.storage import fsync_dir, fsync_tree, open_to_umask
from common.transport import LeaseLost
from common.weights.adapters import write_adapter
from common.weights.reading import digest

log = logging.getLogger(__name__)


_VERSION_DIR = re.compile(r"^v(\d{6,})$")
LEASE_TOKEN_FILE = "lease_token"  # the publishing learner's lease token (learner.fencing)
# (token, version) -> whether a learner wrote it after another took the run over (learner.fencing decides).
Superseded = Callable[[int, int], bool]


def version_dir(root: str | os.PathLike[str], version: int) -> Path:
    return Path(root) / f"v{version:06d}"


@dataclass(frozen=True)
class Published:
    announcement: WeightsAnnouncement
    nbytes: int
    seconds: float


def publish(
    model: Any,
    tokenizer: Any,
    root: str | os.PathLike[str],
    version: int,
    keep: int,
    dtype: str = "model",
    digest_algorithm: str = "xxh3-128",
    *,
    prune_in_background: bool = False,
    state_dict: dict[str, torch.Tensor] | None = None,
    protect: Collection[int] = (),
    token: int = 0,
    superseded: Superseded | None = None,
    base: dict[str, str] | None = None,
) -> Published:
    """Write ``version`` atomically and prune old versions. The caller announces it (see Transport).

    ``dtype`` (``weights.dtype``): the floating-point tensors are written in it (``model``: as they are), and the
    saved ``config.json`` says so; a float32 learner then publishes the bfloat16 its actors serve, half the bytes.
    ``digest_algorithm`` (``weights.digest``): see the module's docstring. ``state_dict``: the tensors to write when
    they are not the model's own (a sharded learner gathers them whole first). With ``prune_in_background`` (the
    learner's choice) old versions are deleted by a thread while training goes on: freeing a model's pages costs as
    much as a third of writing it, and nobody waits for it. ``protect``: versions the prune keeps whatever their
    number (the one announced now); ``version`` itself is always kept. ``token``: the publishing learner's lease
    token, kept in the version's ``lease_token`` file; a version of a higher token is never replaced or pruned, and
    one that ``superseded(token, version)`` says a learner wrote after another took the run over is pruned and never
    counted (learner.fencing). ``base`` (learner.lora: the base model's identity, common.model.lora): the version
    is the model's adapter alone, announced as ``lora-safetensors``, with ``base.json`` beside it.

    One writer at a time in a process (the learner's training loop and its broadcast thread both publish): a
    publish waits for the one before it and for that one's prune, so a prune never runs beside a write of this
    process. Every file and the directory are synced before the rename, and the rename after it: a version that
    other state depends on (an announcement, groups deleted from Redis) is never a name over empty files after a
    power loss."""
    t0 = time.perf_counter()
    root = Path(root)
    with _one_writer:
        wait_pruned(root)
        root.mkdir(parents=True, exist_ok=True)
        final, checked, nbytes = _write_version(model, tokenizer, root, version, dtype, digest_algorithm, state_dict,
                                                token, base)  # fmt: skip
        kept = {version, *protect}
        if prune_in_background:
            _pruning[root] = _pruner.submit(prune, root, keep, kept, token, superseded)
        else:
            prune(root, keep, kept, token, superseded)
    fmt = "hf-safetensors" if base is None else "lora-safetensors"
    ann = WeightsAnnouncement(version=version, uri=str(final), digest=checked, format=fmt)
    return Published(ann, nbytes, time.perf_counter() - t0)


def _write_version(
    model: Any,
    tokenizer: Any,
    root: Path,
    version: int,
    dtype: str,
    digest_algorithm: str,
    state_dict: dict[str, torch.Tensor] | None,
    token: int = 0,
    base: dict[str, str] | None = None,
) -> tuple[Path, str, int]:
    """Write a version under a temporary name this process owns (see prune), sync it, and rename it into place."""
    tmp = root / f".tmp-v{version:06d}-{_OWNER}-{uuid.uuid4().hex[:8]}"
    try:
        state = state_dict if state_dict is not None or base is None else adapter_state(model)
        if dtype != "model":
            cast = getattr(torch, dtype)
            whole = state if state is not None else model.state_dict()
            state = {k: v.to(cast) if v.is_floating_point() else v for k, v in whole.items()}
        if base is not None:  # learner.lora: the adapter alone (the actors hold the base and its tokenizer)
            write_adapter(model, tmp, state, base)
        else:
            model.save_pretrained(tmp, state_dict=state, safe_serialization=True, max_shard_size="50GB")
            if dtype != "model":
                _set_config_dtype(tmp / "config.json", dtype)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        checked, nbytes = digest(tmp, digest_algorithm)
        (tmp / "digest").write_text(checked + "\n")
        (tmp / LEASE_TOKEN_FILE).write_text(f"{token}\n")
        open_to_umask(tmp)  # an SGLang server of another user reads the version too
        fsync_tree(tmp)
        final = version_dir(root, version)
        if final.exists():  # a version re-published after a resume replaces the old copy
            if (theirs := version_token(final)) > token:
                raise LeaseLost(f"{final} is a newer learner's (lease token {theirs}): another learner holds the run")
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(root)
        return final, checked, nbytes
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _set_config_dtype(path: Path, dtype: str) -> None:
    config = json.loads(path.read_text())
    for key in ("dtype", "torch_dtype"):  # the name transformers writes changed between versions
        if key in config:
            config[key] = dtype
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def prune(
    root: str | os.PathLike[str],
    keep: int,
    protect: Collection[int] = (),
    token: int = 0,
    superseded: Superseded | None = None,
) -> None:
    """Keep the newest ``keep`` versions and those in ``protect`` (the announced one: after a resume it may be
    numbered below versions a lost learner left). Also removes half-written ``.tmp-v*`` copies, but only this
    process's own (none is being written: see publish) or ones untouched for ``_TMP_MAX_AGE_S`` (a killed
    publisher's): another publisher's copy in progress is never deleted under it. A version of a lease token above
    ``token`` (a newer learner's) is left alone; one ``superseded`` is removed and not counted (see publish)."""
    for leftover in Path(root).glob(".tmp-v*"):
        if _OWNER in leftover.name or _untouched_for(leftover) > _TMP_MAX_AGE_S:
            shutil.rmtree(leftover, ignore_errors=True)
    counted = []
    for v, path in _versions(Path(root)):
        t = version_token(path)
        if not path.is_dir() or t > token:
            continue
        if superseded is not None and superseded(t, v) and v not in protect:
            shutil.rmtree(path, ignore_errors=True)
        else:
            counted.append((v, path))
    for v, path in counted[:-keep] if keep > 0 else counted:
        if v not in protect:
            shutil.rmtree(path, ignore_errors=True)


def newest_on_disk(root: str | os.PathLike[str], superseded: Superseded | None = None) -> int:
    """The highest version under ``weights.dir`` (-1: none): a version some actor may hold, announced or not; one
    ``superseded`` (written by a learner after another took the run over, never announced) does not count."""
    if not Path(root).is_dir():
        return -1
    return max((v for v, p in _versions(Path(root)) if superseded is None or not superseded(version_token(p), v)),
               default=-1)  # fmt: skip


def version_token(path: Path) -> int:
    """The lease token of the learner that wrote a version (0: none, an earlier build's or unreadable)."""
    try:
        return int((path / LEASE_TOKEN_FILE).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def _versions(root: Path) -> list[tuple[int, Path]]:
    """The entries under ``root`` named as versions (``v000012``), by version."""
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _VERSION_DIR.match(p.name)))


def _untouched_for(directory: Path) -> float:
    """Seconds since anything in ``directory`` (itself or a file in it) was last modified."""
    try:
        times = [directory.lstat().st_mtime] + [e.stat(follow_symlinks=False).st_mtime for e in os.scandir(directory)]
    except OSError:  # removed meanwhile, or unreadable: not ours to judge
        return 0.0
    return time.time() - max(times)


# Each publishing process's temporary copies carry its token, so that its prune can tell them from another's.
_OWNER = f"p{os.getpid()}{uuid.uuid4().hex[:6]}"
# A temporary copy untouched this long is a killed publisher's leftover (saving a shard touches its file throughout).
_TMP_MAX_AGE_S = 3600.0
_one_writer = threading.Lock()
_pruner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-prune")  # joined at interpreter exit
_pruning: dict[Path, Future[None]] = {}


def wait_pruned(root: str | os.PathLike[str] | None = None) -> None:
    """Wait for the background prune of ``root`` (of every root when None); a failed one is logged, not raised:
    the versions it left are removed by the next."""
    for r in [Path(root)] if root is not None else list(_pruning):
        future = _pruning.pop(r, None)
        if future is not None and (error := future.exception()) is not None:
            log.warning("pruning old weight versions in %s failed: %s", r, error)
