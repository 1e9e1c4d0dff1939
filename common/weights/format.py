"""The safetensors format, read without the safetensors library (common.weights uses it): a file's header, its
tensors as views of a buffer already verified against the announced digest, the names, dtypes and shapes from the
headers alone, whether tensors fit the model being served, and loading them into a model all or nothing."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.weights.files import WeightsError, WeightsMismatch, open_regular

# safetensors' dtype names (https://github.com/huggingface/safetensors: an 8-byte little-endian header length, a
# JSON header of name → dtype, shape, [begin, end) offsets after the header, then the data, little-endian).
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def _header(m: Any) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header, read from a buffer that holds at least it, and where its data starts."""
    (n,) = struct.unpack_from("<Q", m, 0)
    header = json.loads(bytes(m[8 : 8 + n]))
    if not isinstance(header, dict):
        raise ValueError("the header is not a map")
    return header, 8 + n


def buffer_tensors(m: Any, where: str) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, as views of its buffer."""
    try:
        header, start = _header(m)
        out: dict[str, torch.Tensor] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype, shape, (begin, end) = _DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
            if not all(type(d) is int and 0 <= d <= len(m) for d in shape):
                raise ValueError(f"tensor {name}: shape {shape!r}")
            numel = math.prod(shape)
            if not 0 <= begin <= end <= len(m) - start or end - begin != numel * dtype.itemsize:
                raise ValueError(f"tensor {name}: offsets {begin}..{end} do not fit its shape or the file")
            if (start + begin) % dtype.itemsize:
                raise ValueError(f"tensor {name}: offset {start + begin} is not aligned to its {dtype}")
            if numel == 0:
                out[name] = torch.empty(shape, dtype=dtype)
            else:
                out[name] = torch.frombuffer(m, dtype=dtype, count=numel, offset=start + begin).view(shape)
        return out
    except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError, RuntimeError) as e:
        raise WeightsError(f"{where}: not a safetensors file ({type(e).__name__}: {e})") from None


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} {list(self.shape)}"


def specs_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {k: TensorSpec(t.dtype, tuple(t.shape)) for k, t in tensors.items()}


def tensor_specs(directory: str | os.PathLike[str], *, published: bool = True) -> dict[str, TensorSpec]:
    """Name → dtype and shape of every tensor in a directory's ``*.safetensors`` files, from their headers alone.
    ``published``: a version of the weights store (regular files only); False for a model directory of the
    user's, whose files may be symlinks (a Hugging Face cache)."""
    specs: dict[str, TensorSpec] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        try:
            with open_regular(path, follow_symlinks=not published) as f:
                prefix = f.read(8)
                (n,) = struct.unpack("<Q", prefix)
                if n > 100 * 2**20:
                    raise ValueError(f"a header of {n} bytes")
                header, _ = _header(prefix + f.read(n))
            for k, v in header.items():
                if k != "__metadata__":
                    specs[k] = TensorSpec(_DTYPES[v["dtype"]], tuple(int(d) for d in v["shape"]))
        except (OSError, struct.error, ValueError, KeyError, TypeError) as e:
            raise WeightsError(f"{path}: not a safetensors file ({type(e).__name__}: {e})") from None
    return specs


def mismatch(
    served: Mapping[str, TensorSpec], new: Mapping[str, TensorSpec], optional: Collection[str] = ()
) -> str | None:
    """Why tensors ``new`` cannot replace ``served`` in place, or None when they can (pure). Every served name must
    come, except those in ``optional`` (weights tied to another, left out of the files), and no other; shapes must
    be equal; a floating-point tensor may come in another floating-point dtype (``weights.dtype`` publishes
    bfloat16 to a float32 engine, and the copy casts), any other tensor in its own dtype only."""
    both = sorted(served.keys() & new.keys())
    shapes = [f"{k} {list(new[k].shape)} (served {list(served[k].shape)})" for k in both
              if new[k].shape != served[k].shape]  # fmt: skip
    dtypes = [f"{k} {new[k]} (served {served[k]})" for k in both if not _castable(new[k].dtype, served[k].dtype)]
    missing = sorted(served.keys() - new.keys() - set(optional))
    unknown = sorted(new.keys() - served.keys())
    problems = [f"shapes {', '.join(shapes[:3])}" if shapes else "",
                f"dtypes {', '.join(dtypes[:3])}" if dtypes else "",
                f"missing {missing[:3]}" if missing else "", f"unknown {unknown[:3]}" if unknown else ""]  # fmt: skip
    return "; ".join(p for p in problems if p) or None


def _castable(new: torch.dtype, served: torch.dtype) -> bool:
    return new == served or (new.is_floating_point and served.is_floating_point)


def load_into(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy tensors into a model of the same architecture, all or nothing: names, shapes and dtypes are checked
    against the model's before any tensor is touched (``load_state_dict(strict=False)`` copies whatever fits before
    it reports missing names, and raises on a wrong shape after overwriting part of the model). Only tied
    parameters may be absent from the file."""
    check_fits(model, state)
    with torch.no_grad():
        model.load_state_dict(state, strict=False)


def check_fits(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor], served: Mapping[str, TensorSpec] | None = None
) -> None:
    """WeightsMismatch unless ``state`` can replace ``model``'s tensors (``served``: their names, dtypes and shapes
    where they are not the model's own state dict's, e.g. a model wrapped with LoRA layers)."""
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    tied |= {"lm_head.weight"} if getattr(getattr(model, "config", None), "tie_word_embeddings", False) else set()
    if problem := mismatch(served or specs_of(model.state_dict()), specs_of(state), optional=tied):
        raise WeightsMismatch(f"weights do not fit the model: {problem}")
