"""The one reading of the machine: which SGLang kernel build a CPU runs, whether bfloat16 is native, and what a
result records. Each CPU kind is a set of cpuinfo flags, as GRPO_CPU_FLAGS makes the machine report it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import ConfigError, check_engine
from common.hardware import X86_64_V3, X86_64_V4_AMX, Cpu, read_cpu, resolve_bf16, sglang_cpu_build

REPO = Path(__file__).resolve().parents[2]
# The kinds of machine this project meets, as /proc/cpuinfo lists their flags (only those that matter here).
ZEN3 = " ".join(X86_64_V3) + " sse4_2"  # AMD EPYC Zen 3: AVX2, no AVX-512
ZEN4 = ZEN3 + " avx512f avx512bw avx512cd avx512dq avx512vl avx512_bf16 avx512_vnni"  # AVX-512 + BF16, no AMX
SAPPHIRE_RAPIDS = " ".join(X86_64_V4_AMX) + " " + ZEN3  # Intel Xeon: AVX-512 and AMX
OLD = "sse2 sse4_2 avx"  # no AVX2


def cpu(flags: str, arch: str = "x86_64") -> Cpu:
    return Cpu(vendor="v", model="Some CPU", arch=arch, cores=2, flags=frozenset(flags.split()))


@pytest.mark.parametrize(
    ("flags", "build"),
    [(SAPPHIRE_RAPIDS, "x86-64-v4"), (ZEN4, "x86-64-v3"), (ZEN3, "x86-64-v3"), (OLD, None)],
    ids=["amx", "avx512-no-amx", "avx2", "no-avx2"],
)
def test_the_kernel_build_follows_the_cpus_flags(flags: str, build: str | None) -> None:
    assert sglang_cpu_build(cpu(flags))[0] == build


def test_a_cpu_that_runs_no_build_is_told_which_feature_it_lacks() -> None:
    build, why = sglang_cpu_build(cpu(OLD))
    assert build is None and "avx2" in why and "fma" in why and "Some CPU" in why
    assert sglang_cpu_build(cpu(ZEN3, arch="aarch64")) == (None, "SGLang's CPU kernel builds are for x86-64 and this "
                                                                 "CPU is aarch64")  # fmt: skip


def test_bfloat16_is_native_only_with_amx_or_avx512_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu(SAPPHIRE_RAPIDS).native_bf16() and cpu(ZEN4).native_bf16()
    assert not cpu(ZEN3).native_bf16()
    for flags, native in ((ZEN3, False), (ZEN4, True)):
        monkeypatch.setenv("GRPO_CPU_FLAGS", flags)
        assert resolve_bf16("auto", "cpu") is native
        assert resolve_bf16("bfloat16", "cpu") and not resolve_bf16("off", "cpu")


def test_the_description_names_the_cpu_its_features_and_what_it_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu(ZEN4).describe() == "Some CPU (x86_64; AVX2 AVX-512 AVX512-BF16, no AMX-BF16), 2 cores"
    monkeypatch.setenv("GRPO_CPU_FLAGS", ZEN3)
    described = read_cpu().describe()
    assert "AVX2, no AVX-512/AVX512-BF16/AMX-BF16" in described and "flags from $GRPO_CPU_FLAGS" in described


def test_the_setup_scripts_ask_with_a_bare_python() -> None:
    """scripts/sglang_env.sh runs `python3 -m common.hardware sglang-build` before any venv exists: stdlib only."""
    env = {"PATH": "/usr/bin:/bin", "GRPO_CPU_FLAGS": ZEN3}
    ok = subprocess.run([sys.executable, "-S", "-m", "common.hardware", "sglang-build"], cwd=REPO, env=env,
                        capture_output=True, text=True)  # fmt: skip
    assert ok.returncode == 0 and ok.stdout.splitlines()[0] == "x86-64-v3", ok.stderr
    env["GRPO_CPU_FLAGS"] = OLD
    no = subprocess.run([sys.executable, "-S", "-m", "common.hardware", "sglang-build"], cwd=REPO, env=env,
                        capture_output=True, text=True)  # fmt: skip
    assert no.returncode == 2 and no.stdout == "" and len(no.stderr.strip().splitlines()) == 1


def test_sglang_on_a_cpu_that_cannot_run_it_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRPO_CPU_FLAGS", OLD)
    with pytest.raises(ConfigError, match=r"^config error: actor.engine: sglang cannot run on this CPU: .*avx2"):
        check_engine("sglang", "", "cpu")
    check_engine("local", "", "cpu")  # nothing to check
    check_engine("sglang", "http://elsewhere:30000", "cpu")  # a server on another machine
    monkeypatch.setenv("GRPO_CPU_FLAGS", ZEN3)
    check_engine("sglang", "", "cpu")


def test_the_sglang_setup_refuses_such_a_cpu_before_installing_anything(tmp_path: Path) -> None:
    if shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0:
        pytest.skip("with a GPU the set-up installs SGLang's CUDA build, whatever the CPU")
    venv = tmp_path / "venv-sglang"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GRPO_CPU_FLAGS": OLD, "GRPO_SGLANG_VENV": str(venv),
           "SGLANG_PYTHON": sys.executable}  # fmt: skip
    done = subprocess.run(["bash", "scripts/sglang_env.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("sglang_env: no SGLang on this CPU: SGLang's CPU kernel needs avx2"), line
    assert not venv.exists()
