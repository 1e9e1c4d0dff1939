"""Learner throughput: the real trainer (learner.trainer.Trainer, the configured loss) on a randomly initialised Llama,
fed synthetic groups; prints tokens/s and model FLOPs utilisation (MFU). Needs no Redis, no dataset, no download.

    python benchmarks/learner_throughput.py --preset 0.5b --device cuda --dtype bfloat16     # scripts/gpu_check.sh
    python benchmarks/learner_throughput.py --preset tiny --device cpu --steps 2             # a smoke run
    python benchmarks/learner_throughput.py --model DIR --dtype float32 --threads 1 -o learner.autocast=auto \
        --groups 8 --group-size 8 --prompt-len 30 --completion-len 16 --grad-accum 1            # the CPU recipe's step

``-o learner.lora.rank=16`` trains a LoRA adapter instead of every weight (the report's ``trainable_parameters``;
on the CPU ``peak_rss_mib``, the process's peak resident memory).

``--model`` trains a pretrained HF directory (e.g. SmolLM2, imported by ``grpo import-model``) instead of a preset;
``-o learner.autocast=off|bfloat16|auto`` sets the precision of its forward passes. The report names the machine
(CPU model and features, cores, load) and the autocast it resolved to.

MFU counts 6 N FLOPs per token for the training forward and backward plus 2 N for the scoring forward that gives
the old log-probs (learner.old_logprobs = proximal), N = parameters without the embeddings, against the GPU's dense
bf16 peak (--peak-tflops, or known from the device name).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

PRESETS = {
    # about 0.5B parameters, Qwen2.5-0.5B-like proportions in a plain Llama
    "0.5b": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024),
}  # fmt: skip
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}  # dense bf16


def synthetic_groups(  # type: ignore[no-untyped-def]
    n: int, size: int, prompt_len: int, completion_len: int, vocab: int, rng: np.random.Generator, shortest: int = 0
):
    """Groups of random tokens; each completion ``completion_len`` long, or with ``shortest`` a length drawn
    uniformly from [shortest, completion_len] (uneven, as sampled answers are)."""
    from common.schemas import Completion, GroupMessage

    groups = []
    for i in range(n):
        prompt = rng.integers(3, vocab, prompt_len, dtype=np.int32)
        lengths = rng.integers(shortest, completion_len + 1, size) if shortest else [completion_len] * size
        completions = tuple(
            Completion(
                rng.integers(3, vocab, int(length), dtype=np.int32),
                np.full(int(length), -np.log(vocab), np.float32),
                float(j % 2),
                "length" if length == completion_len else "stop",
            )
            for j, length in enumerate(lengths)
        )
        groups.append(GroupMessage(f"p{i}", 0, "bench", prompt, completions))
    return groups


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="0.5b")
    p.add_argument("--model", default=None, help="a pretrained HF model directory instead of a preset")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--steps", type=int, default=6, help="timed steps (after one warm-up step)")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=512)
    p.add_argument(
        "--completion-min",
        type=int,
        default=0,
        help="uneven completions: lengths drawn from [this, --completion-len] (0: all that long)",
    )
    p.add_argument("--grad-accum", type=int, default=4)
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE", help="learner config")
    args = p.parse_args()

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from common.config import load_config
    from common.hardware import machine
    from learner.trainer import Trainer, disable_dropout

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device)
    else:
        model = LlamaForCausalLM(LlamaConfig(**PRESETS[args.preset], torch_dtype=args.dtype)).to(args.device, dtype)
    vocab = model.config.vocab_size
    disable_dropout(model)
    if args.device.startswith("cuda"):
        model.gradient_checkpointing_enable()
    n_params = sum(p.numel() for p in model.parameters())
    n_compute = n_params - model.get_input_embeddings().weight.numel()
    cfg = load_config(
        None,
        [f"run.steps={args.steps + 1}", f"learner.batch_groups={args.groups}", f"sampling.group_size={args.group_size}",
         f"sampling.max_new_tokens={args.completion_len}", f"learner.grad_accum={args.grad_accum}",
         f"model.device={args.device}", *args.override],
        env={},
    )  # fmt: skip
    lora = cfg.learner.lora
    if lora.rank:  # -o learner.lora.rank=16: the adapter alone is trained, as the learner does (learner.process)
        from common.model.lora import peft_config, wrap

        model = wrap(model, peft_config(lora.rank, lora.alpha, lora.dropout, lora.target_modules))
    trainer = Trainer(cfg, model, pad_id=0)
    rng = np.random.default_rng(0)
    step_tokens = []  # each step's real tokens (prompt and completion, no padding)

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    times, padding = [], []
    for step in range(args.steps + 1):
        groups = synthetic_groups(args.groups, args.group_size, args.prompt_len, args.completion_len,
                                  vocab, rng, args.completion_min)  # fmt: skip
        sync()
        t0 = time.perf_counter()
        stats = trainer.step(groups, 0)
        sync()
        if step > 0:  # the first step pays for allocation and kernel selection
            times.append(time.perf_counter() - t0)
            step_tokens.append(sum(len(g.prompt_ids) + len(c.token_ids) for g in groups for c in g.completions))
            padding.append(stats.get("padding_frac", 0.0))
        assert np.isfinite(stats["loss"]), stats
    step_s = statistics.median(times)
    tokens_per_step = statistics.median(step_tokens)
    tokens_per_s = tokens_per_step / step_s  # real tokens: padding is work, not throughput
    report: dict[str, object] = {
        "model": args.model or args.preset,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "dtype": args.dtype,
        "autocast": cfg.learner.autocast,
        "bf16_compute": trainer.bf16,
        "threads": torch.get_num_threads(),
        "parameters": n_params,
        "lora_rank": lora.rank,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "micro_batch_tokens": cfg.learner.micro_batch_tokens,
        "grad_accum": cfg.learner.grad_accum,
        "pack_sequences": cfg.learner.pack_sequences,
        "attention": getattr(trainer.model.config, "_attn_implementation", None),
        "completion_lengths": [args.completion_min or args.completion_len, args.completion_len],
        "tokens_per_step": tokens_per_step,
        "padding_frac": round(statistics.mean(padding), 4),
        "step_s_median": round(step_s, 3),
        "tokens_per_s": round(tokens_per_s, 1),
        "step_s": [round(t, 3) for t in times],
        "machine": machine(),
    }
    peak = args.peak_tflops
    if peak is None and args.device.startswith("cuda"):
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in str(report["device"])), None)
    if peak:
        report["mfu"] = round(8 * n_compute * tokens_per_s / (peak * 1e12), 4)
        report["peak_tflops"] = peak
    if args.device.startswith("cuda"):
        report["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    else:  # the process's peak resident memory: the model, its gradients, the optimizer's state, activations
        import resource

        report["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
