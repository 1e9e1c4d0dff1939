"""LoRA adapters as a version holds them (``learner.lora``), in the layout peft reads and writes:
``adapter_config.json`` (peft's) and ``adapter_model.safetensors`` (peft's names:
``base_model.model.<module>.lora_A.weight``), which is what peft's ``PeftModel.from_pretrained`` and SGLang's
``/load_lora_adapter`` read, and ``base.json``: the base model's path and the digest of its safetensors files. An
adapter means nothing on another base of the same shapes, so whoever applies one checks the digest of the base it
holds against that first (:func:`check_base`). The model wrapped in peft's layers is common.model.lora.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from common.model.lora import adapter_state, served_config
from common.weights.files import WeightsError, WeightsMismatch, open_regular
from common.weights.format import mismatch, specs_of
from common.weights.reading import digest

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
BASE_FILE = "base.json"


def is_adapter_dir(directory: str | os.PathLike[str]) -> bool:
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def read_config(directory: str | os.PathLike[str]) -> Any:
    """peft's LoraConfig of an adapter directory; WeightsError where it has none that peft reads (a version pruned
    meanwhile, a file that is not one)."""
    from peft import LoraConfig

    try:
        return LoraConfig.from_pretrained(str(directory))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise WeightsError(f"{directory}: no LoRA adapter config peft reads ({type(e).__name__}: {e})") from None


def base_specs(model: Any) -> dict[str, Any]:
    """The names, dtypes and shapes of a LoRA-wrapped model's base weights as a plain model has them (peft renames a
    wrapped layer's weight ``<layer>.base_layer.weight``): what whole weights replacing the base must fit."""

    state = model.get_base_model().state_dict()
    return {k.replace(".base_layer.", "."): v for k, v in specs_of(state).items() if ".lora_" not in k}


def load_adapter(model: Any, state: Mapping[str, torch.Tensor]) -> None:
    """Copy an adapter's tensors into ``model``'s adapter, all or nothing: names, shapes and dtypes are checked
    first (peft's own loader copies what fits and reports the rest after), so a version of another rank or other
    layers leaves the served adapter as it was."""
    from peft import set_peft_model_state_dict

    if problem := mismatch(specs_of(adapter_state(model)), specs_of(state)):
        raise WeightsMismatch(f"the adapter does not fit the served one: {problem}")
    with torch.no_grad():
        set_peft_model_state_dict(model, dict(state))


def write_adapter(
    model: Any, directory: Path, state: Mapping[str, torch.Tensor] | None = None, base: dict | None = None
) -> None:
    """``adapter_config.json``, ``adapter_model.safetensors`` (``state``, or the model's adapter) and, with
    ``base``, ``base.json``: peft's layout without the model card its ``save_pretrained`` adds."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    served_config(model).save_pretrained(str(directory))
    tensors = {k: v.detach().contiguous().cpu() for k, v in (state or adapter_state(model)).items()}
    save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    if base is not None:
        (directory / BASE_FILE).write_text(json.dumps(base, sort_keys=True) + "\n")


def base_identity(model_path: str) -> dict[str, str]:
    """The base model an adapter belongs to: its path and the digest of its safetensors files (symlinks followed:
    a Hugging Face cache links its files to blobs); the digest is "" (nothing to check against) for a hub name or a
    directory without safetensors files. Hashing a 135M model takes a fraction of a second; a 7B one a few seconds,
    once per process."""

    directory = Path(model_path).expanduser()
    if not directory.is_dir():  # a hub name: no files of ours to hash (a partial cache would mislead)
        return {"path": str(model_path), "digest": ""}
    try:
        checked, _ = digest(directory, published=False)
    except (WeightsError, OSError):  # no safetensors (a .bin checkpoint): no digest, and no check against it
        return {"path": str(model_path), "digest": ""}
    return {"path": str(model_path), "digest": checked}


def read_base(directory: str | os.PathLike[str]) -> dict[str, str]:
    """The ``base.json`` of an adapter directory ({} where it has none: then no check can be made)."""

    try:
        with open_regular(Path(directory) / BASE_FILE) as f:  # a version's file: regular files only
            value = json.loads(f.read(1 << 16))
    except (OSError, ValueError, RuntimeError):
        return {}
    return value if isinstance(value, dict) else {}


def base_mismatch(own: Mapping[str, str], wanted: Mapping[str, str]) -> str | None:
    """Why an adapter trained on ``wanted`` must not be applied to the base ``own``, or None (pure). Where either
    digest is unknown (a hub name, a base without safetensors files) there is nothing to compare."""
    if not wanted.get("digest") or not own.get("digest") or wanted.get("digest") == own.get("digest"):
        return None
    return (f"its base model {wanted.get('path', '?')!r} ({str(wanted['digest'])[:24]}…) is not this process's "
            f"{own.get('path', '?')!r} ({str(own.get('digest', ''))[:24]}…)")  # fmt: skip


def check_base(own: Mapping[str, str], directory: str | os.PathLike[str], version: int) -> None:
    """WeightsMismatch unless the adapter version in ``directory`` was trained on the base ``own`` (an engine's
    own base, base_identity): its ``base.json`` must say which base, and its digest agree."""

    if not (recorded := read_base(directory)):
        raise WeightsMismatch(f"weights v{version}: a LoRA adapter without base.json (which base?)")
    if problem := base_mismatch(own, recorded):
        raise WeightsMismatch(f"weights v{version}: a LoRA adapter whose {problem}")
