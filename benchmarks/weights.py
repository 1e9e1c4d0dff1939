"""B4 weights: publishing a version and an actor loading it — ``common.weights.publish`` as the learner calls it
(HF save_pretrained, the xxh3-128 digest, atomic rename, pruning the old versions in the background) then
``load_state_dict`` (map the file, verify the digest) and ``load_into`` (copy into the engine's model) — against
raw ``safetensors.torch.save_file`` and ``load_file`` of the same state dict, measured in the same run.

    .venv/bin/python benchmarks/weights.py [--quick] [--out result.json]

The model is a randomly initialised Llama (about 53M parameters in --quick mode, 160M otherwise) in float32; the
two paths alternate trial by trial and the figure is the median of raw seconds ÷ project seconds (goal ≥ 0.5).
Then a LoRA version of the same model (learner.lora: rank 16 on every linear layer) is published and loaded the
same way: its bytes and seconds beside the full version's (``lora_bytes_ratio``, ``lora_seconds_ratio``).
Prints one JSON object.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import harness  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from common.model.lora import peft_config, wrap  # noqa: E402
from common.weights import load_into, load_state_dict, publish  # noqa: E402
from common.weights.adapters import load_adapter  # noqa: E402

SIZES = {
    "25m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8),
    "100m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
}  # fmt: skip


def build(size: str) -> tuple[torch.nn.Module, int]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, tie_word_embeddings=False, **SIZES[size]))
    return model.eval(), sum(p.numel() for p in model.parameters())


def project(model: torch.nn.Module, engine: torch.nn.Module, root: Path, version: int) -> float:
    os.sync()  # each path starts with no write-back pending from the other (a flush would otherwise land on it)
    t0 = time.perf_counter()
    pub = publish(model, None, root, version, keep=2, prune_in_background=True)  # as the learner publishes
    state, _ = load_state_dict(pub.announcement)
    load_into(engine, state)
    return time.perf_counter() - t0


def raw(model: torch.nn.Module, root: Path, version: int) -> float:
    """The same state dict through plain safetensors, kept on disk as publish keeps versions (the newest two): a
    file deleted right after writing would never reach the disk, which is no baseline."""
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    root.mkdir(parents=True, exist_ok=True)
    os.sync()
    t0 = time.perf_counter()
    save_file(state, str(root / f"v{version}.safetensors"))
    load_file(str(root / f"v{version}.safetensors"))
    elapsed = time.perf_counter() - t0
    (root / f"v{version - 2}.safetensors").unlink(missing_ok=True)
    return elapsed


def adapter(policy: torch.nn.Module, engine: torch.nn.Module, root: Path, version: int) -> tuple[float, int]:
    """A LoRA version (learner.lora) the same way: the adapter published with its base's identity, then read,
    verified and copied into the engine's adapter. Seconds and bytes."""
    os.sync()
    t0 = time.perf_counter()
    pub = publish(policy, None, root, version, keep=2, prune_in_background=True, base=BASE)
    state, _ = load_state_dict(pub.announcement)
    load_adapter(engine, state)
    return time.perf_counter() - t0, pub.nbytes


BASE = {"path": "bench", "digest": ""}  # no base on disk to name: the actors' check is the local engine's, not timed
LORA_RANK = 16


def with_adapter(model: torch.nn.Module) -> torch.nn.Module:
    return wrap(model, peft_config(LORA_RANK, 2.0 * LORA_RANK, 0.0, "all-linear")).eval()


def adapter_trials(size: str, root: Path, trials: int) -> dict[str, object]:
    """Publish-to-loaded of a rank-16 adapter on every linear layer of the same model, beside the full version's."""
    policy, engine = with_adapter(build(size)[0]), with_adapter(build(size)[0])
    adapter(policy, engine, root, 0)  # warm-up
    runs = [adapter(policy, engine, root, v) for v in range(1, trials + 1)]
    shutil.rmtree(root, ignore_errors=True)
    return {"rank": LORA_RANK, "bytes": runs[0][1], "project_s": statistics.median(s for s, _ in runs),
            "trials_project_s": [s for s, _ in runs]}  # fmt: skip


def run(quick: bool) -> dict[str, object]:
    hf_logging.disable_progress_bar()
    size = "25m" if quick else "100m"
    trials = 5 if quick else 7
    model, n_params = build(size)
    engine, _ = build(size)
    with tempfile.TemporaryDirectory(prefix="grpo-bench-weights-") as tmp:
        root = Path(tmp)
        project(model, engine, root / "weights", 0)  # warm-up: imports, page cache
        raw(model, root / "raw", 0)
        p_s, r_s, ratios = [], [], []
        for v in range(1, trials + 1):
            p = project(model, engine, root / "weights", v)
            r = raw(model, root / "raw", v)
            p_s.append(p)
            r_s.append(r)
            ratios.append(r / p)
        shutil.rmtree(root / "weights", ignore_errors=True)
        lora = adapter_trials(size, root / "adapters", trials)
    ratio = statistics.median(ratios)
    return {
        "name": "B4 weights",
        "parameters": n_params,
        "bytes": n_params * 4,
        "project_s": statistics.median(p_s),
        "raw_s": statistics.median(r_s),
        "ratio": ratio,
        "ratio_min": min(ratios),
        "goal": 0.5,
        "ok": ratio >= 0.5,
        "trials_project_s": p_s,  # each trial's seconds, that the figures above can be checked against
        "trials_raw_s": r_s,
        # the same model's LoRA version: bytes and seconds, and how many times fewer / faster than the full one
        "lora": lora,
        "lora_bytes_ratio": n_params * 4 / float(lora["bytes"]),  # type: ignore[arg-type]
        "lora_seconds_ratio": statistics.median(p_s) / float(lora["project_s"]),  # type: ignore[arg-type]
    }


def main() -> int:
    args = harness.parser(__doc__, "a smaller model and fewer trials").parse_args()
    return harness.emit(run(args.quick), args.out)


if __name__ == "__main__":
    sys.exit(main())
