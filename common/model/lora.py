"""LoRA (``learner.lora``): the model wrapped in the peft library's adapter layers, for every role that meets one: the
learner trains the adapter, the local engine serves it, ``grpo export`` merges it. An adapter as a version's files
(and the base it belongs to) is common.weights.adapters."""

from __future__ import annotations

from typing import Any

import torch


def is_lora(model: Any) -> bool:
    """Whether ``model`` is a peft model (the policy with an adapter)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def peft_config(rank: int, alpha: float, dropout: float, target_modules: list[str] | str) -> Any:
    """peft's LoraConfig for a causal LM with these settings (no bias, no modules saved whole: only the adapter)."""
    from peft import LoraConfig

    return LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # peft hints int; it scales by alpha / r, a float either way
        lora_dropout=dropout,
        target_modules=target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def wrap(model: Any, config: Any) -> Any:
    """``model`` with a fresh adapter (B = 0: the wrapped model computes exactly what the base does); only the
    adapter's parameters require grad."""
    from peft import get_peft_model

    return get_peft_model(model, config)


def same_shape(a: Any, b: Any) -> bool:
    """Whether two LoraConfigs make the same adapter: the same tensors and the same scale (a checkpoint or a version
    of another rank, other layers or another alpha is another policy)."""

    def key(c: Any) -> tuple:
        modules = c.target_modules if isinstance(c.target_modules, str) else sorted(c.target_modules)
        return c.r, float(c.lora_alpha), modules, bool(c.use_rslora), bool(c.use_dora)

    return key(a) == key(b)


def served_config(model: Any) -> Any:
    return model.peft_config["default"]


def wrap_as(model: Any, config: Any) -> Any:
    """``model`` with an adapter shaped by ``config`` (a version's, common.weights.adapters.read_config), not yet
    loaded; in eval mode."""
    config.inference_mode = True
    return wrap(model, config).eval()


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names (what ``adapter_model.safetensors`` holds)."""
    from peft import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(model))


def merged(model: Any) -> Any:
    """The base model with the adapter folded into its weights (W + B A · alpha / r), no longer a peft model."""
    return model.merge_and_unload()
