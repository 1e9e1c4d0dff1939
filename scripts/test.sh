#!/usr/bin/env bash
# The whole test suite: unit, integration (a real redis-server per test on a free port), and end-to-end `grpo run`.
# Extra arguments go to pytest, e.g.  ./scripts/test.sh -m "not e2e" -x
set -euo pipefail
cd "$(dirname "$0")/.."
GRPO_EXTRAS=dev source scripts/venv.sh
# The real-server tests (marker sglang) need SGLang's own venv; where it cannot be made they skip, saying why.
./scripts/sglang_env.sh >/dev/null || echo "note: no SGLang environment (above); the tests marked sglang will skip" >&2
exec .venv/bin/python -m pytest "$@"
