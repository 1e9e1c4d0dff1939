"""LoRA versions (learner.lora) on a SGLang server: SGLang 0.5.23's adapter API, as pure functions.

- Launch: ``--enable-lora`` with ``--max-lora-rank`` and ``--lora-target-modules`` (without an adapter at launch the
  server needs both, or it stops at start-up), ``--max-loras-per-batch`` and ``--max-loaded-loras`` (at least the
  former). Adapters arrive later, one per version.
- ``POST /load_lora_adapter`` ``{"lora_name", "lora_path"}``: HTTP 200 with ``success: true``, or 400 with
  ``success: false`` and ``error_message``; a name already loaded is refused (nothing replaced), so each version's
  adapter gets a name of its own, from its version and digest.
- ``/generate`` names the adapter in ``lora_path`` (its name, not a path; one string for every prompt). The reply
  says nothing about it (``weight_version`` is the base's): the version a completion was sampled with is the one
  the request named, fixed for the whole answer.
- ``POST /unload_lora_adapter`` ``{"lora_name"}``: waits for the requests using it, then frees it.
- No ``/flush_cache``: SGLang keys its prefix cache by each load's adapter id, so no entry computed with another
  adapter serves a request.

SGLang's LoRA layers need CUDA (pinned memory, GPU kernels): a CPU server cannot start with ``--enable-lora``, so
LoRA on a CPU runs with the local engine (common.config.checks refuses the other in one line).
"""

from __future__ import annotations

from typing import Any

from common.schemas import WeightsAnnouncement

# peft's "all-linear" on the model families SGLang serves with LoRA (Llama, Qwen, Mistral): every linear layer of
# a block. SGLang's own "all" would also reserve adapter memory for the embedding and the output head.
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Adapters a server holds at once: the current version's, and the one before while a round finishes with it.
LOADED = 4


def launch_args(rank: int, target_modules: list[str] | str) -> list[str]:
    """The launch arguments of a server that will be sent adapters of this rank and these layers."""
    modules = list(ALL_LINEAR) if target_modules == "all-linear" else list(target_modules)
    return ["--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", *modules,
            "--max-loras-per-batch", str(LOADED), "--max-loaded-loras", str(LOADED)]  # fmt: skip


# SGLang serves q/k/v and gate/up as fused layers: a module is covered when its fused layer is.
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}  # fmt: skip


def uncovered(target_modules: list[str] | str, served: list[str] | None) -> list[str]:
    """The layers of our adapters a server started with ``--lora-target-modules served`` would refuse (pure)."""
    ours = list(ALL_LINEAR) if target_modules == "all-linear" else list(target_modules)
    fused = {_FUSED.get(m, m) for m in served or []}
    if "all" in fused:
        return []
    return [m for m in ours if _FUSED.get(m, m) not in fused]


def adapter_name(ann: WeightsAnnouncement) -> str:
    """A name for the version's adapter on the server: a version re-published after a resume (other contents under
    the same number) gets another name, as the server refuses a name it holds."""
    return f"v{ann.version}-{ann.digest.partition(':')[2][:12]}"


def load_body(name: str, directory: str) -> dict[str, Any]:
    return {"lora_name": name, "lora_path": directory, "pinned": False}


def load_refusal(reply: Any) -> str | None:
    """Why ``/load_lora_adapter`` refused (its ``error_message``, or the whole reply when it has none), or None."""
    if isinstance(reply, dict) and reply.get("success"):
        return None
    if isinstance(reply, dict):
        return str(reply.get("error_message") or reply.get("message") or reply)[:500]
    return str(reply)[:500]


def already_loaded(message: str) -> bool:
    """The refusal of a name the server holds: the same version's adapter, announced again."""
    return "because it is already loaded" in message
