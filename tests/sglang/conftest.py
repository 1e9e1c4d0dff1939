"""A real SGLang server for the tests in this folder: SGLang 0.5.23 from its own venv (``scripts/sglang_env.sh``), on
the CPU of a machine without a GPU. Where that environment cannot exist (no GPU and no SGLang CPU kernel), the tests
skip and say why; where it could and is missing, they fail, naming the script that makes it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from actor.engines.sglang.server import PROJECT_VENV
from common.config import Config, load_config


def _kernel_dir() -> Path | None:
    shared = os.environ.get("GRPO_SHARED_DIR")
    path = Path(shared) / "sglang-cpu" if shared else None
    return path if path is not None and path.is_dir() else None


def _set_up() -> bool:
    """scripts/sglang_env.sh finished: it stamps the venv last, so a venv it began and could not finish has none."""
    return any(PROJECT_VENV.parent.parent.glob(".grpo-sglang-*"))


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """The server's interpreter. Skips, saying why, where no SGLang can run here (no GPU, and a CPU that runs neither
    kernel build, or no kernel to install); fails where it could run and its set-up is missing or broke, so that a
    set-up that broke on a machine able to run it is not hidden as a skip."""
    from common.hardware import cuda_device, read_cpu, sglang_cpu_build

    if PROJECT_VENV.is_file() and _set_up():
        return str(PROJECT_VENV)
    if not cuda_device():
        cpu = read_cpu()
        build, why = sglang_cpu_build(cpu)
        if build is None:
            pytest.skip(f"no SGLang on this machine: no GPU, and {why}")
        if _kernel_dir() is None:
            pytest.skip(
                f"no SGLang environment: on a machine without a GPU it needs SGLang's CPU kernel ({build} build for "
                f"{cpu.model}; GRPO_SHARED_DIR with sglang-cpu/), which is not here"
            )
    state = "did not finish (no stamp)" if PROJECT_VENV.is_file() else "is missing"
    pytest.fail(f"SGLang can run on this machine but {PROJECT_VENV.parent.parent} {state}: run scripts/sglang_env.sh, "
                "which says what failed")  # fmt: skip


def server_config(model: Path, run_dir: Path, python: str, *overrides: str) -> Config:
    return load_config(
        None,
        [f"model.path={model}", f"run.dir={run_dir}", "actor.engine=sglang", f"sglang.python={python}",
         "sglang.ready_timeout_s=300", "sglang.timeout_s=120", *overrides],
    )  # fmt: skip


@pytest.fixture(scope="module")
def real_engine(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, sglang_python: str) -> Iterator:
    """An SGLangEngine that launched a real server on the demo model; the events it survived in ``.events``."""
    from actor.engines.sglang.engine import SGLangEngine

    cfg = server_config(demo_model_dir, tmp_path_factory.mktemp("sglang-run"), sglang_python)
    events: list[str] = []
    engine = SGLangEngine(cfg, seed=0, name="test", on_event=events.append)
    engine.events = events  # type: ignore[attr-defined]
    try:
        yield engine
    finally:
        engine.close()
