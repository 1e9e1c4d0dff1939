#!/usr/bin/env bash
# Create or reuse ./.venv and install grpo-pipeline into it (sourced by demo.sh and test.sh) with the extras named by
# GRPO_EXTRAS: dev (tests, benchmarks, linters; the default) for test.sh, embedded,models for demo.sh.
# On a machine without CUDA, torch is the CPU build 2.13.0; with an NVIDIA GPU, pip's default torch build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || { echo "grpo-pipeline needs Python >= 3.10 (set PYTHON=python3.11)" >&2; exit 2; }
  "$PYTHON" -m venv .venv
fi

if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    .venv/bin/pip install --quiet --disable-pip-version-check torch
  else
    .venv/bin/pip install --quiet --disable-pip-version-check torch==2.13.0
  fi
fi

# Reinstall only when the project's dependencies changed since the last install of these extras into this venv: one
# stamp per set, so a venv made by the demo gets the dev extras when test.sh first runs in it.
extras=${GRPO_EXTRAS:-dev}
stamp=".venv/.grpo-installed-$extras"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/pip install --quiet --disable-pip-version-check -e ".[$extras]"
  if [ "$extras" = dev ] && ! .venv/bin/python -c 'import importlib.util as u; exit(u.find_spec("sglang") is None)'; then
    # Only SGLang's request/response schema is used, loaded by file path (tests check the sglang engine's
    # requests with it): the wheel without its GPU dependencies, plus msgspec. Optional: tests skip that check
    # without it.
    .venv/bin/pip install --quiet --disable-pip-version-check --no-deps "sglang==0.5.23" msgspec \
      || echo "note: sglang's schema module could not be installed; the tests will skip that check" >&2
  fi
  echo "$want" > "$stamp"
fi
