"""How a launched SGLang server is started on the CPU: its flags, its environment and the libraries it preloads."""

from __future__ import annotations

from pathlib import Path

import pytest

from actor.engines.sglang.server import PRELOADS, cpu_preloads, launch_command
from common.config import load_config


def _venv(tmp_path: Path, *libs: str) -> Path:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    for lib in libs:
        (tmp_path / "venv" / "lib").mkdir(exist_ok=True)
        (tmp_path / "venv" / "lib" / lib).touch()
    return python


def test_the_venvs_openmp_is_preloaded_first_and_only_what_exists(tmp_path: Path) -> None:
    python = _venv(tmp_path, "libiomp5.so")
    found = cpu_preloads(str(python))
    assert found[0] == str(tmp_path / "venv" / "lib" / "libiomp5.so")
    assert all(Path(f).is_file() and Path(f).name in PRELOADS for f in found)
    assert str(tmp_path / "venv" / "lib" / "libtcmalloc_minimal.so.4") not in found


@pytest.mark.parametrize("preload", [True, False])
def test_a_cpu_server_gets_the_cpu_backend_and_its_preloads(
    tmp_path: Path, preload: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    python = _venv(tmp_path, "libiomp5.so")
    cfg = load_config(None, [f"sglang.python={python}", "sglang.device=cpu", f"sglang.cpu_preload={preload}",
                             "model.path=/m"], env={})  # fmt: skip
    cmd, env = launch_command(cfg, 4321)
    assert cmd[:3] == [str(python), "-m", "sglang.launch_server"] and "--device" in cmd and "cpu" in cmd
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    if preload:
        assert env["LD_PRELOAD"].split(":")[0] == str(tmp_path / "venv" / "lib" / "libiomp5.so")
    else:
        assert "LD_PRELOAD" not in env
