"""The SGLang stand-in's LoRA adapters (tests/sglang_standin.py), as SGLang 0.5.23 serves them: launched with
``--enable-lora --max-lora-rank R --lora-target-modules ...`` (both needed without ``--lora-paths``, or it stops at
start-up), ``POST /load_lora_adapter`` and ``/unload_lora_adapter`` with the real server's replies and refusals,
``/generate`` naming an adapter by name in ``lora_path`` (a string for every prompt, or a list per prompt with null
for the base), and ``/server_info``'s LoRA fields. Adapters are applied with peft on the stand-in's CPU model, so
the log-probs are genuine. Past ``max_loaded_loras`` the least recently used adapter is unloaded, and a name once
loaded is loaded again from its path when a request names it (as the real server keeps a cache of references).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from pathlib import Path
from typing import Any

# SGLang folds q/k/v and gate/up into fused layers; a module is served when its fused layer is.
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}  # fmt: skip


class LoraError(Exception):
    """A /generate naming an adapter the server cannot serve: HTTP 400 with this message."""


class Adapters:
    def __init__(self, base: Any, max_rank: int, targets: list[str], max_loaded: int | None):
        if not max_rank or not targets:
            raise SystemExit(
                "AssertionError: When no initial --lora-paths is provided, you need to specify both --max-lora-rank "
                "and --lora-target-modules for LoRA initialization."
            )
        self.base = base
        self.max_rank = max_rank
        self.targets = targets
        self.max_loaded = max_loaded
        self.loaded: OrderedDict[str, str] = OrderedDict()  # name -> path, least recently used first
        self.known: dict[str, str] = {}  # every name ever loaded (the real server's reference cache)
        self.models: dict[str, Any] = {}

    def server_info(self) -> dict[str, Any]:
        return {"enable_lora": True, "max_lora_rank": self.max_rank, "lora_target_modules": self.targets,
                "max_loaded_loras": self.max_loaded, "lora_paths": []}  # fmt: skip

    def _served(self, module: str) -> bool:
        """SGLang folds the launch list into fused layers too: [q_proj, v_proj] serves k_proj."""
        fused = {_FUSED.get(m, m) for m in self.targets}
        return "all" in fused or _FUSED.get(module, module) in fused

    def load(self, body: dict) -> tuple[int, dict]:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            return 400, {"object": "error", "message": "2 validation errors: lora_name, lora_path: Field required"}
        if name in self.loaded:
            return self._refused(f"Failed to load LoRA adapter {name} because it is already loaded")
        if not Path(path).is_dir():
            return self._refused(f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{path}'. Use "
                                 "`repo_type` argument if needed.")  # fmt: skip
        try:
            model = self._adapted(path)
        except (OSError, ValueError, KeyError, RuntimeError) as e:  # (a WeightsMismatch too)
            return self._refused(f"Cannot find any model weights with `{path}` ({e})")
        config = model.peft_config["default"]
        if config.r > self.max_rank or not all(self._served(m) for m in config.target_modules):
            return self._refused(
                f"LoRA adapter {name} with rank {config.r} is incompatible with the current LoRA memory pool "
                "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`."
            )
        self.loaded[name] = self.known[name] = path
        self.models[name] = model
        while self.max_loaded is not None and len(self.loaded) > self.max_loaded:  # least recently used first
            evicted, _ = self.loaded.popitem(last=False)
            self.models.pop(evicted, None)
        return 200, self._reply(True, "")

    def unload(self, body: dict) -> tuple[int, dict]:
        name = body.get("lora_name")
        if name not in self.loaded:
            message = f"LoRA with name {name} does not exist. Loaded LoRAs: odict_keys({list(self.loaded)})"
            return 400, {**self._reply(False, message), "loaded_adapters": None}
        del self.loaded[name]
        self.models.pop(name, None)
        return 200, self._reply(True, "")

    def models_for(self, lora_path: Any, n_prompts: int) -> list[Any]:
        """Each prompt's model: the base, or the named adapter's (loaded again if evicted or unloaded)."""
        names = lora_path if isinstance(lora_path, list) else [lora_path] * n_prompts
        if len(names) < n_prompts:
            raise IndexError("list index out of range")  # the real server answers HTTP 500
        out = []
        for name in names[:n_prompts]:
            if name is None:
                out.append(self.base)
                continue
            if name not in self.loaded:
                if name not in self.known:
                    raise LoraError(f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: "
                                    f"dict_keys({list(self.loaded)}).")  # fmt: skip
                self.load({"lora_name": name, "lora_path": self.known[name]})
            self.loaded.move_to_end(name)
            out.append(self.models[name])
        return out

    def _adapted(self, path: str) -> Any:
        from safetensors.torch import load_file

        from common.model.lora import wrap_as
        from common.weights.adapters import ADAPTER_WEIGHTS, load_adapter, read_config

        model = wrap_as(copy.deepcopy(self.base), read_config(path)).eval()
        load_adapter(model, load_file(str(Path(path) / ADAPTER_WEIGHTS)))
        return model

    def _reply(self, success: bool, message: str) -> dict:
        return {"rid": None, "http_worker_ipc": None, "success": success, "error_message": message,
                "loaded_adapters": dict(self.loaded)}  # fmt: skip

    def _refused(self, message: str) -> tuple[int, dict]:
        return 400, self._reply(False, message)


def disabled(name: Any) -> LoraError:
    """A request naming an adapter on a server started without --enable-lora."""
    return LoraError(
        f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server with --enable-lora "
        "flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
    )
