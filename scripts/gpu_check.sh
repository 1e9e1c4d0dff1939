#!/usr/bin/env bash
# The prepared GPU check (a few minutes): the learner's real training step on a GPU, with a randomly initialised
# ~0.5B Llama in bf16, printing tokens/s and MFU as one JSON line per configuration.
#   ./scripts/gpu_check.sh                 # uses ./.venv if it has CUDA torch, else python3 on PATH
#   PYTHON=/path/to/python ./scripts/gpu_check.sh
# Needs torch with CUDA, transformers, numpy, safetensors, msgpack, pydantic and pyyaml importable (no network).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_python.sh  # PYTHON, checked to have torch with CUDA
# Two batch shapes of the demo's loss (dapo, 4 mini-batches per step): short and long completions.
"$PYTHON" benchmarks/learner_throughput.py --preset 0.5b --dtype bfloat16 --steps 5 --groups 16 --group-size 8 \
  --prompt-len 128 --completion-len 512 --grad-accum 2
"$PYTHON" benchmarks/learner_throughput.py --preset 0.5b --dtype bfloat16 --steps 3 --groups 8 --group-size 8 \
  --prompt-len 256 --completion-len 2048 --grad-accum 4
# learner.autocast auto on a GPU: float32 weights, off and auto side by side; auto must report bf16_compute true.
for autocast in off auto; do
  "$PYTHON" benchmarks/learner_throughput.py --preset 0.5b --dtype float32 --steps 3 --groups 8 --group-size 8 \
    --prompt-len 128 --completion-len 256 --grad-accum 2 -o "learner.autocast=$autocast"
done
# With two GPUs or more: weights.transport nccl's broadcast from the learner (cuda:0) to actors on the other GPUs,
# against the disk path (one GPU cannot hold two ranks of a NCCL group), and the learner under torchrun.
if [ "$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  "$PYTHON" benchmarks/broadcast.py --backend nccl
fi
