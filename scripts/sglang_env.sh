#!/usr/bin/env bash
# Create or reuse ./.venv-sglang: a SGLang server's own environment (SGLang pins its own torch and
# transformers, so it cannot share .venv). `actor.engine=sglang` launches its servers with this venv's python.
#
# - With an NVIDIA GPU: pip's SGLang 0.5.23 with its CUDA dependencies, as the actor image has it.
# - Without one: torch 2.14.1, sglang 0.5.23 without its GPU dependencies, the runtime packages a CPU server
#   imports, and SGLang's CPU kernel (sgl_kernel), which PyPI does not carry. The kernel comes from a directory
#   `sglang-cpu/` under $GRPO_SHARED_DIR (or ../shared), in the build this CPU runs (`python3 -m common.hardware
#   sglang-build`: x86-64-v4 with AMX, else x86-64-v3 with AVX2; chosen before anything is installed): its ready build
#   when this venv's Python and torch are the ones it was built for, else built from the kernel source there (about
#   17 minutes on 2 cores).
#
# Prints the venv's python on the last line; exits 2, saying what is missing in one line, where it cannot be set up
# (a CPU that runs neither build among them). Re-running is cheap: a stamp records what was installed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=${GRPO_SGLANG_VENV:-.venv-sglang}
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.14.1
say() { echo "sglang_env: $*" >&2; }
pip_install() { "$VENV/bin/pip" install --quiet --disable-pip-version-check "$@"; }

gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
PYTHON=${SGLANG_PYTHON:-$(command -v python3.11 || command -v python3)}
# Which kernel build this CPU runs, before 7 GB are installed for nothing (common/hardware.py reads the CPU).
build=cuda
if [ $gpu = 0 ]; then
  choice=$("$PYTHON" -m common.hardware sglang-build 2>&1) || { say "no SGLang on this CPU: $choice"; exit 2; }
  build=$(echo "$choice" | head -1)
fi
stamp="$VENV/.grpo-sglang-$SGLANG_VERSION-$build"
if [ -f "$stamp" ] && [ -x "$VENV/bin/python" ]; then
  echo "$VENV/bin/python"
  exit 0
fi

# The CPU kernel's ready builds are for CPython 3.11; any Python >= 3.10 works when the kernel is built from source.
shared=${GRPO_SHARED_DIR:-}
[ -n "$shared" ] || { [ -d ../shared ] && shared=$(cd ../shared && pwd); } || true
kernel_dir=${shared:+$shared/sglang-cpu}
if [ $gpu = 0 ] && { [ -z "$kernel_dir" ] || [ ! -d "$kernel_dir" ]; }; then
  say "no GPU, and no SGLang CPU kernel: set GRPO_SHARED_DIR to a directory with sglang-cpu/ (a kernel build or its source), or build sgl-kernel's csrc/cpu from SGLang's source (sgl-kernel/pyproject_cpu.toml) into $VENV yourself"
  exit 2
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
say "setting up $VENV (SGLang $SGLANG_VERSION, $([ $gpu = 1 ] && echo CUDA || echo "CPU, kernel build $build"))"
if [ $gpu = 1 ]; then
  pip_install "sglang==$SGLANG_VERSION"
else
  # torch's CUDA build from PyPI: it runs on CPUs, and the only torchvision to be had needs it.
  pip_install "torch==$TORCH_VERSION" torchvision
  pip_install --no-deps "sglang==$SGLANG_VERSION"
  # What a CPU server imports, found by launching one: SGLang's other requirements are GPU kernels.
  pip_install -c <(echo "torch==$TORCH_VERSION") \
    fastapi uvicorn uvloop orjson pyzmq msgspec "transformers==5.19.0" "tokenizers==0.23.2" safetensors \
    huggingface_hub psutil requests setproctitle pybase64 python-multipart numpy pillow prometheus-client einops \
    partial_json_parser packaging aiohttp tqdm pydantic regex IPython dill jsonschema "apache-tvm-ffi==0.1.11" \
    "sentencepiece==0.2.1" "compressed-tensors==0.18.0" gguf "openai==2.8.0" "xgrammar==0.2.7" "soundfile==0.13.1" \
    intel-openmp
  # The allocators SGLang's CPU recipe preloads (sglang.cpu_preload); without them the server runs, a little slower.
  if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4 && command -v apt-get >/dev/null 2>&1 \
      && [ "$(id -u)" = 0 ]; then
    { apt-get install -y -q libtcmalloc-minimal4 libtbbmalloc2 \
      || { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4 libtbbmalloc2; }; } >/dev/null 2>&1 \
      || say "could not install libtcmalloc-minimal4 and libtbbmalloc2: the server runs without them"
  fi
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  abi=$("$VENV/bin/python" -c 'import sys, torch; print(f"cp{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__.partition(chr(43))[0]}")')
  # The AMX build lies at the top of sglang-cpu/, the AVX2 one in avx2/, each with its build script.
  ready=$(find "$kernel_dir" -maxdepth 2 -name "sgl_kernel-cpu-*-$abi-${build/x86-64/x86_64}.tar.gz" | sort | head -1)
  builder=$kernel_dir/build_kernel.py
  [ "$build" = x86-64-v4 ] || builder=$kernel_dir/avx2/build_kernel_avx2.py
  if [ -n "$ready" ]; then
    tar -xzf "$ready" -C "$site"
  else
    src=$(ls "$kernel_dir"/sgl-kernel-src-*.tar.gz 2>/dev/null | head -1 || true)
    [ -n "$src" ] && [ -f "$builder" ] \
      || { say "no ready $build kernel build for $abi and no kernel source with $(basename "$builder") in $kernel_dir"; exit 2; }
    say "no ready $build kernel build for $abi: building it from $(basename "$src") (about 17 minutes on 2 cores)"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    tar -xzf "$src" -C "$work"
    kernel_src=$(dirname "$(find "$work" -path '*/csrc/cpu' -type d | head -1)")
    kernel_src=$(dirname "$kernel_src")
    pip_install ninja setuptools
    (cd "$work" && SGL_KERNEL_SRC="$kernel_src" MAX_JOBS=${MAX_JOBS:-2} "$OLDPWD/$VENV/bin/python" \
      "$builder" build_ext >"$work/build.log" 2>&1) \
      || { say "building the kernel failed (it needs g++ and libnuma-dev); last lines:"; tail -5 "$work/build.log" >&2; exit 2; }
    cp -r "$kernel_src/python/sgl_kernel" "$site/"
    cp "$work"/build/lib*/sgl_kernel/common_ops*.so "$site/sgl_kernel/"
  fi
  # Loading the kernel runs its code: a build for another CPU dies here (SIGILL), a missing library says so.
  set +e
  err=$("$VENV/bin/python" -c 'import sgl_kernel.common_ops' 2>&1)
  code=$?
  set -e
  if [ $code = 132 ]; then
    say "the $build SGLang CPU kernel dies with Illegal instruction on this CPU ($("$PYTHON" -m common.hardware)): it needs another build"
    exit 2
  elif [ $code != 0 ]; then
    say "the SGLang CPU kernel does not load in $VENV: $(echo "$err" | tail -1)$(echo "$err" | grep -q libnuma && echo ' (apt-get install libnuma1)')"
    exit 2
  fi
fi
touch "$stamp"
echo "$VENV/bin/python"
