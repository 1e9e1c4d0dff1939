#!/bin/sh
# `pip install ...` as the images run it: `sh pip.sh install ARGS`. With PIP_OFFLINE=1 (scripts/build-images.sh
# --offline) every package comes from the wheelhouse mounted at /wheels and no index is asked; otherwise from the
# package index, with TORCH_INDEX_URL beside it when set, so that a torch the base image lacks is PyTorch's CPU build
# (PyPI's Linux torch is the CUDA build, several GB). Without a cache: what pip downloads is not kept in the image.
set -eu
command=$1
shift
if [ -n "${PIP_OFFLINE:-}" ]; then
  exec python3 -m pip "$command" --no-cache-dir --no-index --find-links /wheels "$@"
fi
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  set -- --extra-index-url "$TORCH_INDEX_URL" "$@"
fi
exec python3 -m pip "$command" --no-cache-dir "$@"
