#!/usr/bin/env bash
# The prepared GPU check of learner.micro_batch_tokens (a few minutes): the learner's real step on a randomly
# initialised ~0.5B Llama in bf16, with long uneven completions (256-token prompts, 512-2,048-token answers), its
# mini-batches split by rows (learner.grad_accum) and by a token budget, unpacked and packed (learner.pack_sequences:
# sdpa, transformers' default, with a block-diagonal mask per packed row); one JSON
# line per setting with tokens/s (real tokens, padding not counted), MFU and the padding share (padding_frac).
#   ./scripts/gpu_micro_batches.sh            # PYTHON=/path/to/python to choose the interpreter
# Needs torch with CUDA, transformers, numpy, safetensors, msgpack, pydantic and pyyaml importable (no network).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_python.sh  # PYTHON, checked to have torch with CUDA
# 8 groups of 8: 64 rows in 2 mini-batches (updates_per_batch 2) of 32 rows each.
common=(--preset 0.5b --dtype bfloat16 --steps 3 --groups 8 --group-size 8 --prompt-len 256
        --completion-len 2048 --completion-min 512 -o learner.updates_per_batch=2)
# By rows: 4 micro-batches of 8 rows, each padded to its longest.
"$PYTHON" benchmarks/learner_throughput.py "${common[@]}" --grad-accum 4
# By tokens: at most the positions of 8 rows of the longest (the rows split's worst case), then half of it.
for budget in 18432 9216; do
  "$PYTHON" benchmarks/learner_throughput.py "${common[@]}" --grad-accum 1 -o "learner.micro_batch_tokens=$budget"
done
# Packed: the rows split and the larger budget again, each forward's rows laid end to end.
"$PYTHON" benchmarks/learner_throughput.py "${common[@]}" --grad-accum 4 -o learner.pack_sequences=true
"$PYTHON" benchmarks/learner_throughput.py "${common[@]}" --grad-accum 1 -o learner.micro_batch_tokens=18432 \
  -o learner.pack_sequences=true
