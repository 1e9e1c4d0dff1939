"""Checkpoints: everything a learner needs to resume exactly where it stopped. No pickle anywhere.

``<checkpoint.dir>/step-000123/`` holds

- ``model.safetensors`` + ``config.json``: the policy (``save_pretrained``); with ``learner.lora`` the adapter alone
  instead (``adapter_model.safetensors`` + ``adapter_config.json``, common.model.lora), and ``state.json`` names the
  base model it was trained on (path and digest): a resume on another base is refused, as is one that would put an
  adapter into a full-weight run or the other way round;
- ``optimizer.safetensors``: every tensor of the optimizer state (AdamW's moments and step counts);
- ``rng.safetensors``: torch's CPU (and CUDA) generator states and the trainer's shuffling generator;
- ``state.json``: step, policy version, the run's identity and lineage (``run_id``, ``epochs``), the optimizer's
  param groups and non-tensor state, the LR scheduler's state, counters, and the stream entries trained on since the
  previous checkpoint (``covers``): they are acknowledged right after the checkpoint is written, and a learner that
  resumes from it acknowledges them first, so a crash between the two never trains a group twice.

A checkpoint is written under a temporary name, synced to disk (files, then directories) and renamed into place, and
the rename is synced too: the groups it covers are deleted from Redis right after, so a power loss must not leave a
renamed checkpoint with empty files. Only the newest ``checkpoint.keep`` stay. Each carries the lease token of the
learner that wrote it, and one written by a learner after another took the run over is never resumed from and is
pruned (learner.fencing); ``holders/`` keeps each holder's marker. A checkpoint that cannot be read back
whole (a file missing, empty or cut short) is set aside as ``step-NNNNNN.damaged`` with one log line, and the learner
resumes from the newest whole one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from common.config import ConfigError
from common.model.lora import same_shape, served_config
from common.storage import fsync_dir, fsync_tree, writing
from common.transport import LeaseLost
from common.weights import WeightsError, load_into
from common.weights.adapters import ADAPTER_WEIGHTS, base_mismatch, load_adapter, read_config, write_adapter
from learner.distributed import Ranks
from learner.fencing import superseded_steps

log = logging.getLogger("learner")

_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_STATE_KEYS = ("step", "version", "counters", "covers", "covers_groups", "optimizer", "scheduler")


@dataclass
class Resumable:
    """What a checkpoint restores besides the tensors."""

    step: int
    version: int
    counters: dict[str, Any] = field(default_factory=dict)
    covers: list[str] = field(default_factory=list)  # stream entry ids trained since the previous checkpoint
    covers_groups: list[str] = field(default_factory=list)  # and their group ids
    run_id: str = ""  # the run's identity in Redis (a Redis that no longer holds it lost the run's state)
    epochs: list[list[int]] = field(default_factory=list)  # the lineage: [epoch, step, first version] (learner.lineage)
    lease_token: int = 0  # the fencing token of the learner that wrote it (learner.fencing); 0: an earlier build's
    covers_positions: list[int] = field(default_factory=list)  # their prompt positions (-1: none; all: older builds)


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
    base: dict[str, str] | None = None,
) -> Path | None:
    """Write a checkpoint (see the module's docstring); with ``ranks``, every rank calls it, the model and optimizer
    are gathered whole, and rank 0 writes the same files (the others return None)."""
    if ranks is None:
        model_state, optim = None, optimizer.state_dict()
    else:
        model_state, optim = ranks.full_model_state(model), ranks.full_optimizer_state(model, optimizer)
        if not ranks.is_rank0:
            return None
    root = Path(root)
    with writing(root):  # a read-only or full disk: one line and exit 2, and nothing acknowledged (see the caller)
        root.mkdir(parents=True, exist_ok=True)
        final = root / f"step-{resumable.step:06d}"
        tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            _write_files(tmp, resumable, model, model_state, optim, scheduler, generator, base)
            # Contents on disk before the name: the caller acknowledges (deletes) the covered groups right after.
            fsync_tree(tmp)
            if final.exists():  # the same step written again after a resume
                if (theirs := _token(final)) > resumable.lease_token:
                    raise LeaseLost(f"{final} is a newer learner's (lease token {theirs}): another learner holds the "
                                    "run")  # fmt: skip
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_dir(root)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    for leftover in root.glob(".tmp-step-*"):  # half-written by a learner that was killed (this one is renamed)
        shutil.rmtree(leftover, ignore_errors=True)
    _prune(root, keep, resumable.lease_token)
    return final


def _prune(root: Path, keep: int, token: int) -> None:
    """Keep the newest ``keep`` checkpoints that count; remove the rest, and those a learner wrote after a newer one
    took the run over (learner.fencing); never one of a newer learner than ``token``'s."""
    superseded = superseded_steps(root)
    counted: list[int] = []
    for step in sorted(_steps(root)):
        t = _token(root / f"step-{step:06d}")
        if t > token:
            continue
        if superseded(t, step):
            shutil.rmtree(root / f"step-{step:06d}", ignore_errors=True)
        else:
            counted.append(step)
    for old in counted[:-keep]:
        shutil.rmtree(root / f"step-{old:06d}", ignore_errors=True)


def _token(path: Path) -> int:
    """The lease token a checkpoint was written under (0: none, or unreadable: a damaged one is judged elsewhere)."""
    try:
        return int(json.loads((path / "state.json").read_text()).get("lease_token", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def _write_files(
    tmp: Path,
    resumable: Resumable,
    model: Any,
    model_state: dict[str, torch.Tensor] | None,
    optim: dict[str, Any],
    scheduler: Any,
    generator: torch.Generator,
    base: dict[str, str] | None = None,
) -> None:
    if base is not None:  # learner.lora: the adapter; the base is the model.path it names
        write_adapter(model, tmp)
    else:
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
        "covers_positions": resumable.covers_positions,
        "run_id": resumable.run_id,
        "epochs": resumable.epochs,
        "lease_token": resumable.lease_token,
        "optimizer": opt_meta,
        "scheduler": scheduler.state_dict(),
        **({"base": base} if base is not None else {}),
    }
    (tmp / "state.json").write_text(json.dumps(state))


def _steps(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return [int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / "state.json").is_file()]


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint that counts (learner.fencing) and can be read back whole, or None. A newer one that
    cannot (torn by a crash or a full disk, emptied by a power loss) is renamed ``step-NNNNNN.damaged``, kept for
    inspection and out of the way of pruning, with one log line naming it: the learner resumes from the one before,
    whose groups Redis still has."""
    root = Path(root)
    superseded = superseded_steps(root)
    for step in sorted(_steps(root), reverse=True):
        path = root / f"step-{step:06d}"
        if superseded(_token(path), step):  # written by a learner after another took the run over: never resumed
            log.info("ignoring %s: written by a learner after a newer one took the run over", path)
            continue
        problem = damage(path)
        if problem is None:
            return path
        aside = path.with_name(f"{path.name}.damaged")
        if aside.exists():
            shutil.rmtree(aside, ignore_errors=True)
        os.rename(path, aside)
        log.warning("checkpoint %s is damaged (%s): set aside as %s; resuming from an earlier one", path, problem,
                    aside.name)  # fmt: skip
    return None


def step_of(path: Path | None) -> int:
    """The step of a checkpoint directory (0: None, no checkpoint)."""
    m = _STEP_DIR.match(path.name) if path is not None else None
    return int(m.group(1)) if m else 0


def damage(path: Path) -> str | None:
    """What makes the checkpoint at ``path`` unreadable, or None: ``state.json`` parses and has every field, and
    every safetensors file is whole (its header parses and the file is as long as the header says). Cheap: the
    tensors themselves are not read."""
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"state.json: {e}"
    if not isinstance(state, dict) or (missing := [k for k in _STATE_KEYS if k not in state]):
        return f"state.json: missing {missing if isinstance(state, dict) else 'everything'}"
    models = _model_files(path)
    if not models:
        return f"no model*.safetensors or {ADAPTER_WEIGHTS}"
    for f in [*models, path / "optimizer.safetensors", path / "rng.safetensors"]:
        if problem := _safetensors_damage(f):
            return f"{f.name}: {problem}"
    return None


def _model_files(path: Path) -> list[Path]:
    """The policy's files of a checkpoint: the whole model's, or the adapter's (learner.lora)."""
    return sorted(path.glob("model*.safetensors")) or sorted(path.glob(ADAPTER_WEIGHTS))


def _safetensors_damage(f: Path) -> str | None:
    """A safetensors file is an 8-byte little-endian header length, a JSON header giving each tensor's byte range,
    then the bytes: a file cut short or emptied fails one of these checks."""
    try:
        size = f.stat().st_size
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8).ljust(8, b"\0"))
            if n == 0 or 8 + n > size:
                return f"{size} bytes, header length {n}"
            header = json.loads(fh.read(n))
        end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return f"unreadable header ({e})"
    if size != 8 + n + end:
        return f"{size} bytes where the header says {8 + n + end}"
    return None


def load(
    path: str | os.PathLike[str],
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    generator: torch.Generator,
    ranks: Ranks | None = None,
    base: dict[str, str] | None = None,
) -> Resumable:
    """Restore a checkpoint into objects built from the same config; returns the rest. With ``ranks``, every rank
    reads the whole files and keeps its shards: a checkpoint resumes on any number of ranks. ``base``: the base
    model's identity when the policy is a LoRA adapter (common.model.lora), None for whole weights; a checkpoint
    of the other kind, or of an adapter on another base, is a ConfigError before anything is loaded."""
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    _same_kind(path, state, base)
    model_state: dict[str, torch.Tensor] = {}
    for f in _model_files(path):
        model_state.update(load_file(str(f)))
    optim = _optimizer_state(load_file(str(path / "optimizer.safetensors")), state["optimizer"])
    if base is not None:
        _same_adapter(path, model)
        load_adapter(model, model_state)
        optimizer.load_state_dict(optim)
    elif ranks is None:
        load_into(model, model_state)
        optimizer.load_state_dict(optim)
    else:
        ranks.load_full_state(model, optimizer, model_state, optim)
    scheduler.load_state_dict(state["scheduler"])
    rng = load_file(str(path / "rng.safetensors"))
    torch.set_rng_state(rng["torch"])
    generator.set_state(rng["trainer"])
    if torch.cuda.is_available():
        cuda = cuda_rng_states(rng)
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    return Resumable(
        state["step"], state["version"], state["counters"], state["covers"], state["covers_groups"],
        state.get("run_id", ""), state.get("epochs", []),  # absent in an earlier build's checkpoint
        int(state.get("lease_token", 0)), _positions(state.get("covers_positions"), len(state["covers"])),
    )  # fmt: skip


def _positions(saved: Any, n: int) -> list[int]:
    """The covered groups' prompt positions; -1 each where an earlier build's checkpoint kept none."""
    if not isinstance(saved, list) or len(saved) != n or not all(type(p) is int for p in saved):
        return [-1] * n
    return saved


def _same_kind(path: Path, state: dict[str, Any], base: dict[str, str] | None) -> None:
    """A resume must put back what this learner trains: an adapter on the same base, or whole weights."""
    adapter = (path / ADAPTER_WEIGHTS).is_file()
    if adapter != (base is not None):
        held, trains = ("a LoRA adapter", "whole weights") if adapter else ("whole weights", "a LoRA adapter")
        raise ConfigError(f"config error: learner.lora.rank: checkpoint {path} holds {held}, this learner trains "
                          f"{trains}; set learner.lora as the run began, or give it another run.name")  # fmt: skip
    if base is not None and (problem := base_mismatch(base, state.get("base") or {})):
        raise ConfigError(f"config error: model.path: checkpoint {path} holds an adapter whose {problem}; resume "
                          "with the base it was trained on")  # fmt: skip


def _same_adapter(path: Path, model: Any) -> None:
    """The checkpoint's adapter must be the one this learner trains: the same rank, layers and alpha (another alpha
    would rescale the policy mid-run without a word)."""
    try:
        theirs = read_config(path)
    except WeightsError as e:
        raise ConfigError(f"config error: learner.lora: checkpoint {path}: {e}") from None
    ours = served_config(model)
    if not same_shape(theirs, ours):
        raise ConfigError(f"config error: learner.lora: checkpoint {path} holds an adapter of rank {theirs.r}, alpha "
                          f"{theirs.lora_alpha:g} on {sorted(theirs.target_modules)}, this learner trains rank "
                          f"{ours.r}, alpha {ours.lora_alpha:g} on {sorted(ours.target_modules)}; set learner.lora as "
                          "the run began, or give it another run.name")  # fmt: skip


def cuda_rng_states(rng: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The saved CUDA generator states in device order: ``cuda.2`` before ``cuda.10`` (the names' string order would
    give device 10's state to device 2 on a machine with more than ten)."""
    return [rng[k] for k in sorted((k for k in rng if k.startswith("cuda.")), key=lambda k: int(k.split(".", 1)[1]))]
