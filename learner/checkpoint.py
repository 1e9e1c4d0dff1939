"""Checkpoints: everything a learner needs to resume exactly where it stopped. No pickle anywhere.

``<checkpoint.dir>/step-000123/`` holds

- ``model.safetensors`` + ``config.json``: the policy (``save_pretrained``);
- ``optimizer.safetensors``: every tensor of the optimizer state (AdamW's moments and step counts);
- ``rng.safetensors``: torch's CPU (and CUDA) generator states and the trainer's shuffling generator;
- ``state.json``: step, policy version, the optimizer's param groups and non-tensor state, the LR scheduler's state,
  counters, and the stream entries trained on since the previous checkpoint (``covers``): they are acknowledged
  right after the checkpoint is written, and a learner that resumes from it acknowledges them first, so a crash
  between the two never trains a group twice.

A checkpoint is written under a temporary name and renamed into place; only the newest ``checkpoint.keep`` stay.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from common.weights import load_into
from learner.distributed import Ranks

_STEP_DIR = re.compile(r"^step-(\d{6,})$")


@dataclass
class Resumable:
    """What a checkpoint restores besides the tensors."""

    step: int
    version: int
    counters: dict[str, Any] = field(default_factory=dict)
    covers: list[str] = field(default_factory=list)  # stream entry ids trained since the previous checkpoint
    covers_groups: list[str] = field(default_factory=list)  # and their group ids


def _optimizer_parts(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, state in sd["state"].items():
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{name}"] = value.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(index), {})[name] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    for index, values in meta["scalars"].items():
        state.setdefault(int(index), {}).update(values)
    return {"state": state, "param_groups": meta["param_groups"]}


def save(
    root: str | os.PathLike[str],
    resumable: Resumable,
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    generator: torch.Generator,
    keep: int,
    ranks: Ranks | None = None,
) -> Path | None:
    """Write a checkpoint (see the module's docstring); with ``ranks``, every rank calls it, the model and optimizer
    are gathered whole, and rank 0 writes the same files (the others return None)."""
    if ranks is None:
        model_state, optim = None, optimizer.state_dict()
    else:
        model_state, optim = ranks.full_model_state(model), ranks.full_optimizer_state(model, optimizer)
        if not ranks.main:
            return None
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{resumable.step:06d}"
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp, state_dict=model_state, safe_serialization=True, max_shard_size="50GB")
        opt_tensors, opt_meta = _optimizer_parts(optim)
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
        rng = {"torch": torch.get_rng_state(), "trainer": generator.get_state()}
        if torch.cuda.is_available():
            rng |= {f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
        save_file(rng, str(tmp / "rng.safetensors"))
        state = {
            "step": resumable.step,
            "version": resumable.version,
            "counters": resumable.counters,
            "covers": resumable.covers,
            "covers_groups": resumable.covers_groups,
            "optimizer": opt_meta,
            "scheduler": scheduler.state_dict(),
        }
        (tmp / "state.json").write_text(json.dumps(state))
        if final.exists():  # the same step written again after a resume
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    for leftover in root.glob(".tmp-step-*"):  # half-written by a learner that was killed (this one is renamed)
        shutil.rmtree(leftover, ignore_errors=True)
    for old in sorted(_steps(root))[:-keep]:
        shutil.rmtree(root / f"step-{old:06d}", ignore_errors=True)
    return final


def _steps(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return [int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / "state.json").is_file()]


def latest(root: str | os.PathLike[str]) -> Path | None:
    steps = _steps(Path(root))
    return Path(root) / f"step-{max(steps):06d}" if steps else None


def load(
    path: str | os.PathLike[str],
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    generator: torch.Generator,
    ranks: Ranks | None = None,
) -> Resumable:
    """Restore a checkpoint into objects built from the same config; returns the rest. With ``ranks``, every rank
    reads the whole files and keeps its shards: a checkpoint resumes on any number of ranks."""
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    model_state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("model*.safetensors")):
        model_state.update(load_file(str(f)))
    optim = _optimizer_state(load_file(str(path / "optimizer.safetensors")), state["optimizer"])
    if ranks is None:
        load_into(model, model_state)
        optimizer.load_state_dict(optim)
    else:
        ranks.load_full_state(model, optimizer, model_state, optim)
    scheduler.load_state_dict(state["scheduler"])
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["torch"])
    generator.set_state(rng["trainer"])
    if torch.cuda.is_available():
        cuda = [rng[k] for k in sorted(rng) if k.startswith("cuda.")]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    return Resumable(state["step"], state["version"], state["counters"], state["covers"], state["covers_groups"])
