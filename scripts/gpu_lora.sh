#!/usr/bin/env bash
# The prepared GPU check of learner.lora (a few minutes): the learner's real step on a randomly initialised ~0.5B
# Llama in bf16, every weight trained against a rank-16 adapter on every linear layer (peak GPU memory,
# max_memory_gib, and step time: one JSON line each), then B4's publish-to-loaded of a whole version against the
# same model's adapter version (benchmarks/weights.py: bytes and seconds, lora_bytes_ratio, lora_seconds_ratio).
#   ./scripts/gpu_lora.sh            # PYTHON=/path/to/python to choose the interpreter
# Needs torch with CUDA, transformers, peft, numpy, safetensors, xxhash, msgpack, pydantic and pyyaml importable
# (no network).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_python.sh  # PYTHON, checked to have torch with CUDA
"$PYTHON" -c 'import peft' || { echo "gpu_lora: peft is not installed for $PYTHON" >&2; exit 2; }
common=(--preset 0.5b --dtype bfloat16 --steps 3 --groups 8 --group-size 8 --prompt-len 256 --completion-len 1024
        --grad-accum 4 -o learner.updates_per_batch=2)
"$PYTHON" benchmarks/learner_throughput.py "${common[@]}"
"$PYTHON" benchmarks/learner_throughput.py "${common[@]}" -o learner.lora.rank=16 -o learner.lora.alpha=32
"$PYTHON" benchmarks/weights.py
