"""The weight store: one HF-format safetensors directory per policy version, on a volume learner and actors share.

Layout: ``<weights.dir>/v000012/`` holds ``config.json``, ``model.safetensors`` (or shards), tokenizer files, and
``sha256`` (the digest announced in ``weights:latest``). A version is written under a temporary name and renamed
into place, so a reader sees either nothing or the whole directory; only the newest ``keep`` versions stay.
The digest covers every ``*.safetensors`` file in name order; actors check it before loading.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import mmap
import os
import re
import shutil
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.schemas import WeightsAnnouncement

log = logging.getLogger(__name__)

_VERSION_DIR = re.compile(r"^v(\d{6,})$")


class WeightsError(RuntimeError):
    """A published version is missing, incomplete, or does not match its digest."""


def version_dir(root: str | os.PathLike[str], version: int) -> Path:
    return Path(root) / f"v{version:06d}"


def digest(directory: str | os.PathLike[str]) -> tuple[str, int]:
    """sha256 over every ``*.safetensors`` file in name order, and their total size in bytes."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{directory}: no *.safetensors files")
    maps = [_map(f) for f in files]
    try:
        return _sha256(maps), sum(len(m) for m in maps)
    finally:
        for m in maps:
            m.close()


def _map(path: Path) -> mmap.mmap:
    """A private, copy-on-write mapping of a whole file: hashing and loading read the page cache in place, with no
    copy into Python bytes (which cost more than the hash itself). The mapping keeps the file's contents even if the
    version is pruned or re-published meanwhile (both unlink or rename, the store never writes a file in place)."""
    with path.open("rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            raise WeightsError(f"{path}: empty file")
        return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)


def _sha256(maps: list[mmap.mmap]) -> str:
    h = hashlib.sha256()
    for m in maps:
        h.update(m)  # hashlib releases the GIL over large buffers
    return h.hexdigest()


@dataclass(frozen=True)
class Published:
    announcement: WeightsAnnouncement
    nbytes: int
    seconds: float


def publish(
    model: Any, tokenizer: Any, root: str | os.PathLike[str], version: int, keep: int, dtype: str = "model"
) -> Published:
    """Write ``version`` atomically and prune old versions. The caller announces it (see Transport).

    ``dtype`` (``weights.dtype``): the floating-point tensors are written in it (``model``: as they are), and the
    saved ``config.json`` says so; a float32 learner then publishes the bfloat16 its actors serve, half the bytes."""
    t0 = time.perf_counter()
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-v{version:06d}-{uuid.uuid4().hex[:8]}"
    try:
        state = None
        if dtype != "model":
            cast = getattr(torch, dtype)
            state = {k: v.to(cast) if v.is_floating_point() else v for k, v in model.state_dict().items()}
        model.save_pretrained(tmp, state_dict=state, safe_serialization=True, max_shard_size="50GB")
        if state is not None:
            _set_config_dtype(tmp / "config.json", dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        sha, nbytes = digest(tmp)
        (tmp / "sha256").write_text(sha + "\n")
        final = version_dir(root, version)
        if final.exists():  # a version re-published after a resume replaces the old copy
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    prune(root, keep)
    ann = WeightsAnnouncement(version=version, uri=str(final), sha256=sha)
    return Published(ann, nbytes, time.perf_counter() - t0)


def _set_config_dtype(path: Path, dtype: str) -> None:
    config = json.loads(path.read_text())
    for key in ("dtype", "torch_dtype"):  # the name transformers writes changed between versions
        if key in config:
            config[key] = dtype
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def prune(root: str | os.PathLike[str], keep: int) -> None:
    """Keep the newest ``keep`` versions. Also removes half-written ``.tmp-*`` copies of a killed publisher: the
    learner is a run's only publisher, and it calls this after its own copy was renamed into place."""
    for leftover in Path(root).glob(".tmp-v*"):
        shutil.rmtree(leftover, ignore_errors=True)
    versions = sorted(
        (int(m.group(1)), p) for p in Path(root).iterdir() if (m := _VERSION_DIR.match(p.name)) and p.is_dir()
    )
    for _v, path in versions[:-keep] if keep > 0 else versions:
        shutil.rmtree(path, ignore_errors=True)


def load_state_dict(ann: WeightsAnnouncement) -> tuple[dict[str, torch.Tensor], int]:
    """Read a published version, checking its digest. Returns the tensors and the bytes read.

    Each file is mapped once, and the very bytes that were hashed are the ones the tensors view (no copies: loading
    them into a model is the one copy), so a version pruned or rewritten meanwhile is a WeightsError or the old,
    verified contents, never a half-verified load."""
    directory = Path(ann.uri)
    try:
        maps = [_map(f) for f in sorted(directory.glob("*.safetensors"))]
    except OSError as e:
        raise WeightsError(f"weights v{ann.version}: {e}") from None
    if not maps:
        raise WeightsError(f"weights v{ann.version}: {directory} does not exist or holds no weights (pruned?)")
    _check_digest(ann, _sha256(maps))
    state: dict[str, torch.Tensor] = {}
    for m in maps:
        state.update(_tensors(m, f"weights v{ann.version}"))
    return state, sum(len(m) for m in maps)


# safetensors' dtype names (https://github.com/huggingface/safetensors: an 8-byte little-endian header length, a
# JSON header of name → dtype, shape, [begin, end) offsets after the header, then the data, little-endian).
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def _tensors(m: mmap.mmap, where: str) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, as views of its mapping."""
    try:
        (n,) = struct.unpack_from("<Q", m, 0)
        header = json.loads(m[8 : 8 + n])
        start = 8 + n
        out: dict[str, torch.Tensor] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype, shape, (begin, end) = _DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
            numel = math.prod(shape)
            if not 0 <= begin <= end <= len(m) - start or end - begin != numel * dtype.itemsize:
                raise ValueError(f"tensor {name}: offsets {begin}..{end} do not fit its shape or the file")
            if numel == 0:
                out[name] = torch.empty(shape, dtype=dtype)
            else:
                out[name] = torch.frombuffer(m, dtype=dtype, count=numel, offset=start + begin).view(shape)
        return out
    except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise WeightsError(f"{where}: not a safetensors file ({type(e).__name__}: {e})") from None


def verify(ann: WeightsAnnouncement) -> int:
    """Check a published version's files against its announced sha256 without loading them (for an engine that
    loads them itself, such as a SGLang server); returns their size in bytes. A missing, pruned or altered version
    is a WeightsError."""
    try:
        sha, nbytes = digest(ann.uri)
    except (OSError, ValueError) as e:
        raise WeightsError(f"weights v{ann.version}: {e}") from None
    _check_digest(ann, sha)
    return nbytes


def _check_digest(ann: WeightsAnnouncement, sha: str) -> None:
    if sha != ann.sha256:
        raise WeightsError(f"weights v{ann.version}: sha256 {sha[:12]}… does not match announced {ann.sha256[:12]}…")


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy tensors into a model of the same architecture; only tied parameters may be absent from the file."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    tied |= {"lm_head.weight"} if getattr(getattr(model, "config", None), "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise WeightsError(
            f"weights do not fit the model: missing {sorted(set(missing) - tied)}, unexpected {unexpected}"
        )
