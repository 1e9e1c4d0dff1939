"""Peak memory of sampling, measured in a process of its own: ``python -m tests.memory_probe MODEL ROWS STEPS``
prints one JSON object with the growth of the peak resident set (MiB) that generating ``ROWS`` completions of
``STEPS`` tokens adds, and what keeping every step's full-vocabulary logits would have needed. ``MODEL`` is a
model folder, or ``vocab:N`` for a one-layer random Llama with an N-token vocabulary."""

from __future__ import annotations

import json
import resource
import sys

import torch


def _model(spec: str) -> torch.nn.Module:
    if spec.startswith("vocab:"):
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=int(spec.split(":")[1]), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
            bos_token_id=0, eos_token_id=1, pad_token_id=1,
        )  # fmt: skip
        return LlamaForCausalLM(config).eval()
    from common.model.loading import load_pretrained

    return load_pretrained(spec, "float32", "cpu")[1]


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    from common.model.generation import generate

    spec, rows, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(2)
    model = _model(spec)
    vocab = int(model.config.vocab_size)
    prompts = [[5 + i, 7, 9, 11] for i in range(rows // 8)]
    # A never-sampled stop token keeps every row going for all the steps: the worst case.
    kw = {"n": 8, "stop_ids": {vocab - 1}, "pad_id": 0, "temperature": 1.0}
    generate(model, prompts, max_new_tokens=2, **kw)  # warm the allocator and the code paths
    before = peak_mib()
    groups = generate(model, prompts, max_new_tokens=steps, **kw)
    lengths = {len(s.token_ids) for g in groups for s in g}
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    positions = len(prompts[0]) + steps
    kv_bytes = c.num_hidden_layers * 2 * rows * positions * c.num_key_value_heads * head_dim * 4
    print(json.dumps({
        "vocabulary": vocab,
        "rows": rows,
        "steps": steps,
        "lengths": sorted(lengths),
        "growth_mib": peak_mib() - before,
        "kv_cache_mib": kv_bytes / 2**20,
        "all_logits_mib": rows * steps * vocab * 4 / 2**20,  # one float32 copy of every step's logits
    }))  # fmt: skip


if __name__ == "__main__":
    main()
