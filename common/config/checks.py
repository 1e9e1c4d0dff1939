"""Checks of the machine against the config: the model path and the device exist here. Run before any process
starts, so that a user's mistake is one line, not a traceback after minutes of loading."""

from __future__ import annotations

import re
from pathlib import Path

from common.config.loading import ConfigError

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_model_path(path: str) -> None:
    """A model path that is neither a model directory nor a hub name (``org/name``) is a user's mistake."""
    if not path:
        raise ConfigError("config error: model.path: empty; give an HF model directory or hub name")
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise ConfigError(f"config error: model.path: {path} is not a model directory (no config.json)")
    elif not _HUB_NAME.match(path):
        raise ConfigError(f"config error: model.path: {path}: no such directory")


def check_device(device: str) -> None:
    """``model.device`` must be a device this machine has: checked before any process starts or any model loads,
    because torch's own failure comes after minutes of loading, as a traceback from inside ``model.to``."""
    if device == "cpu":
        return  # every machine has one: `grpo run` on the CPU is spared importing torch this early
    import torch

    try:
        where = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"config error: model.device: {device!r} is not a torch device (cpu, cuda, cuda:1)") from None
    if where.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = "is built without CUDA" if torch.version.cuda is None else "sees no CUDA device"
            raise ConfigError(f"config error: model.device: {device}: torch here {build}; use cpu")
        if where.index is not None and where.index >= count:
            raise ConfigError(f"config error: model.device: {device}: this machine has {count} CUDA device(s)")
    elif where.type != "cpu" and not getattr(getattr(torch, where.type, None), "is_available", lambda: False)():
        raise ConfigError(f"config error: model.device: {device}: this machine has no {where.type} device")


def check_engine(engine: str, url: str, sglang_device: str, lora_rank: int = 0) -> None:
    """``actor.engine=sglang`` launching its server on a CPU that runs neither build of SGLang's CPU kernel is one
    line naming the missing CPU feature, before any process starts (the server would die with Illegal instruction
    after minutes of loading); so is one with LoRA adapters (``lora_rank``, learner.lora.rank), which SGLang serves
    on GPUs only. A server given by ``sglang.url`` runs elsewhere: nothing to check here."""
    if engine != "sglang" or url:
        return
    from common.hardware import cuda_device, read_cpu, sglang_cpu_build

    if sglang_device == "cuda" or (sglang_device == "auto" and cuda_device()):
        return
    if lora_rank:
        raise ConfigError("config error: learner.lora.rank: a SGLang server on the CPU cannot serve LoRA adapters "
                          "(SGLang's LoRA layers need CUDA); use actor.engine=local, or sglang.url of a GPU "
                          "server")  # fmt: skip
    build, why = sglang_cpu_build(read_cpu())
    if build is None:
        raise ConfigError(f"config error: actor.engine: sglang cannot run on this CPU: {why}; use actor.engine=local, "
                          "or sglang.url of a server on another machine")  # fmt: skip
