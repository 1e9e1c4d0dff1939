# Sourced by the prepared GPU checks (scripts/gpu_check.sh, scripts/gpu_micro_batches.sh), from the repository root:
# sets PYTHON (given, or ./.venv where its torch sees CUDA, else python3 on PATH), stops with one line unless that
# python has torch with a CUDA device and transformers, and names the GPU.
PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
  PYTHON=python3
  if [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' \
    2>/dev/null; then PYTHON=.venv/bin/python; fi
fi
"$PYTHON" - "$(basename "$0" .sh)" <<'PY'
import sys
name = sys.argv[1]
try:
    import torch, transformers  # noqa: F401
except ImportError as e:
    sys.exit(f"{name}: {e}; install torch (CUDA) and transformers for this python")
if not torch.cuda.is_available():
    sys.exit(f"{name}: torch sees no CUDA device")
print(f"{name}: {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}",
      file=sys.stderr)
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
