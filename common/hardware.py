"""What this machine can compute: the CPU's vendor, model and vector/matrix features, and the accelerator.

One place reads them, for the set-up scripts (``python3 -m common.hardware sglang-build``: which SGLang CPU kernel
build runs here, before its environment is installed), the engines and the learner (``auto`` dtypes), the config
checks (``actor.engine=sglang`` on a CPU that cannot run it) and the benchmarks (every result names its machine).

Only the standard library at import time: the set-up scripts run this with a bare ``python3``. torch is imported
only to ask about a GPU, and only where it is installed.

``GRPO_CPU_FLAGS`` replaces the flags read from ``/proc/cpuinfo`` (space-separated, as cpuinfo spells them): to see
what the project does on a CPU of another kind, and how the tests check it.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

FLAGS_ENV = "GRPO_CPU_FLAGS"

# cpuinfo's flag names of the features that decide a kernel or a dtype, and how the README names them.
FEATURES = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16"}
# x86-64-v3 (what the AVX2 build of SGLang's CPU kernel is compiled for): the flags its instructions need.
X86_64_V3 = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm")
# The AMX build: x86-64-v4 with AVX512-BF16, AVX512-VNNI and AMX (tile, bf16, int8), as its flags compile it.
X86_64_V4_AMX = ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni",
                 "amx_tile", "amx_bf16", "amx_int8")  # fmt: skip


@dataclass(frozen=True)
class Cpu:
    vendor: str
    model: str
    arch: str
    cores: int
    flags: frozenset[str] = field(default_factory=frozenset)
    flags_from: str = "/proc/cpuinfo"

    def has(self, *flags: str) -> bool:
        return all(f in self.flags for f in flags)

    def features(self) -> list[str]:
        return [name for flag, name in FEATURES.items() if flag in self.flags]

    def describe(self) -> str:
        """``AMD EPYC (x86_64; AVX2 AVX-512 AVX512-BF16, no AMX-BF16), 2 cores``: what a figure was measured on."""
        have = self.features()
        missing = [name for name in FEATURES.values() if name not in have and self.arch in ("x86_64", "AMD64")]
        feats = " ".join(have) or "none of AVX2/AVX-512/AMX"
        if missing:
            feats += ", no " + "/".join(missing)
        forced = f"; flags from {self.flags_from}" if self.flags_from != "/proc/cpuinfo" else ""
        return f"{self.model} ({self.arch}; {feats}{forced}), {self.cores} cores"

    def native_bf16(self) -> bool:
        """The CPU computes bfloat16 matmuls in hardware (AMX or AVX512-BF16). Elsewhere torch emulates them, far
        slower than float32 (measured: 15x on an AVX2-only EPYC for a training step)."""
        return self.has("amx_bf16") or self.has("avx512_bf16")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo; empty where there is none (not Linux)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def read_cpu() -> Cpu:
    info = _cpuinfo()
    forced = os.environ.get(FLAGS_ENV)
    flags = frozenset((forced if forced is not None else info.get("flags", "")).split())
    return Cpu(
        vendor=info.get("vendor_id", platform.processor() or "unknown"),
        model=info.get("model name", platform.processor() or "unknown CPU"),
        arch=platform.machine(),
        cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1),
        flags=flags,
        flags_from=f"${FLAGS_ENV}" if forced is not None else "/proc/cpuinfo",
    )


def sglang_cpu_build(cpu: Cpu) -> tuple[str | None, str]:
    """Which build of SGLang's CPU kernel runs on ``cpu``: ``("x86-64-v4", why)`` (the AMX build), ``("x86-64-v3",
    why)`` (the AVX2 build), or ``(None, why not)`` naming the missing CPU feature.

    The AMX build is for x86-64-v4 with AMX and dies with "Illegal instruction" elsewhere; the AVX2 build is taken on
    every other x86-64-v3 CPU, AVX-512 ones without AMX included. Whether the AVX2 build is also right on an AMX
    machine (where SGLang's Python may pick AMX-only kernels) is not known, so AMX machines keep the AMX build."""
    if cpu.arch not in ("x86_64", "AMD64"):
        return None, f"SGLang's CPU kernel builds are for x86-64 and this CPU is {cpu.arch}"
    if cpu.has(*X86_64_V4_AMX):
        return "x86-64-v4", "AMX and AVX-512: the AMX build"
    missing = [f for f in X86_64_V3 if f not in cpu.flags]
    if missing:
        return None, f"SGLang's CPU kernel needs {' '.join(missing)} (x86-64-v3), which this CPU ({cpu.model}) lacks"
    return "x86-64-v3", "AVX2 without AMX: the AVX2 build"


def cuda_device() -> str | None:
    """The first CUDA GPU's name, or None (no GPU, or no torch to ask)."""
    try:
        import torch
    except ImportError:
        return None
    return str(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None


def bf16_is_native(device: str) -> bool:
    """Whether bfloat16 compute is fast on ``device`` ("cpu", "cuda", "cuda:1", "auto" = the GPU when there is one):
    on a GPU that supports it, on a CPU with AMX or AVX512-BF16."""
    if device == "auto":
        device = "cuda" if cuda_device() else "cpu"
    if device.startswith("cuda"):
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return read_cpu().native_bf16()


def resolve_bf16(setting: str, device: str) -> bool:
    """A dtype setting of ``auto`` | ``bfloat16`` | ``off``/``float32``/``model`` as "compute in bfloat16?"."""
    if setting == "auto":
        return bf16_is_native(device)
    return setting == "bfloat16"


def describe_device(device: str) -> str:
    """The device a figure or a choice is about, in words: a GPU's name, or the CPU described."""
    if device.startswith("cuda"):
        return f"GPU {cuda_device() or device}"
    return read_cpu().describe()


def machine() -> dict:
    """What a benchmark result records of the machine it was measured on."""
    cpu = read_cpu()
    return {
        "cpu": cpu.describe(),
        "cpu_vendor": cpu.vendor,
        "cpu_features": cpu.features(),
        "cores": cpu.cores,
        "load_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "gpu": cuda_device(),
    }


def main(argv: list[str]) -> int:
    """``describe`` (the default): one line; ``json``: everything; ``sglang-build``: the kernel build's tag on the
    first line and why on the second, or why none can run (on stderr) with exit code 2."""
    what = argv[0] if argv else "describe"
    cpu = read_cpu()
    if what == "describe":
        print(cpu.describe())
    elif what == "json":
        print(json.dumps({**asdict(cpu), "flags": sorted(cpu.flags)}, indent=2))
    elif what == "sglang-build":
        build, why = sglang_cpu_build(cpu)
        if build is None:
            print(why, file=sys.stderr)
            return 2
        print(build)
        print(why)
    else:
        print("usage: python -m common.hardware [describe | json | sglang-build]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
