#!/usr/bin/env bash
# The prepared GPU check of actor.weight_updates in_flight (a few minutes): the local engine's sampler on a randomly
# initialised ~0.5B Llama in bf16, 8 prompts x 4 answers of 1,024 tokens, a second version loaded after 256 decode
# steps, keeping the cache and recomputing it (benchmarks/in_flight_engine.py: one JSON line each, the load's pause in
# load_pause_s, and whether every answer finished with the new version's tokens); then, where SGLang and pytest are
# installed for this python, the SGLang engine's pause / update / continue against a real server
# (tests/sglang/test_real_in_flight.py). First, the load under bfloat16 autocast over float32 weights, keep and
# recompute, on the local engine itself (benchmarks/in_flight_autocast.py: its answers against an engine whose every
# cast is fresh, and the stale casts' difference; exit 1 when they are not the same).
#   ./scripts/gpu_in_flight.sh       # PYTHON=/path/to/python to choose the interpreter
# Needs torch with CUDA, transformers, numpy, safetensors, xxhash, msgpack, pydantic and pyyaml importable (no network).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_python.sh  # PYTHON, checked to have torch with CUDA
"$PYTHON" benchmarks/in_flight_autocast.py --preset 0.5b --device cuda --prompts 8 --samples 4 --prompt-len 256 \
  --tokens 512 --load-at 128
"$PYTHON" benchmarks/in_flight_engine.py --preset 0.5b --device cuda --dtype bfloat16 --prompts 8 --samples 4 \
  --prompt-len 256 --tokens 1024 --load-at 256
if "$PYTHON" -c 'import sglang, pytest' 2>/dev/null; then
  "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" tests/sglang/test_real_in_flight.py -s
else
  echo "gpu_in_flight: SGLang or pytest is not installed for $PYTHON: its pause / update / continue path not run" >&2
fi
