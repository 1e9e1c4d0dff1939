"""A real SGLang server for the tests in this folder: SGLang 0.5.23 from its own venv (``scripts/sglang_env.sh``), on
the CPU of a machine without a GPU. Where that environment cannot exist (no GPU and no SGLang CPU kernel), the tests
skip and say why; where it could and is missing, they fail, naming the script that makes it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from actor.sglang_server import PROJECT_VENV
from common.config import Config, load_config


def _kernel_dir() -> Path | None:
    shared = os.environ.get("GRPO_SHARED_DIR")
    path = Path(shared) / "sglang-cpu" if shared else None
    return path if path is not None and path.is_dir() else None


@pytest.fixture(scope="session")
def sglang_python() -> str:
    if PROJECT_VENV.is_file():
        return str(PROJECT_VENV)
    if _kernel_dir() is None:
        pytest.skip(
            "no SGLang environment: on a machine without a GPU it needs SGLang's CPU kernel (GRPO_SHARED_DIR with "
            "sglang-cpu/), which is not here"
        )
    pytest.fail(f"SGLang's CPU kernel is in {_kernel_dir()} but {PROJECT_VENV} is missing: run scripts/sglang_env.sh")


def server_config(model: Path, run_dir: Path, python: str, *overrides: str) -> Config:
    return load_config(
        None,
        [f"model.path={model}", f"run.dir={run_dir}", "actor.engine=sglang", f"sglang.python={python}",
         "sglang.ready_timeout_s=300", "sglang.timeout_s=120", *overrides],
    )  # fmt: skip


@pytest.fixture(scope="module")
def real_engine(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, sglang_python: str) -> Iterator:
    """An SGLangEngine that launched a real server on the demo model; the events it survived in ``.events``."""
    from actor.sglang_engine import SGLangEngine

    cfg = server_config(demo_model_dir, tmp_path_factory.mktemp("sglang-run"), sglang_python)
    events: list[str] = []
    engine = SGLangEngine(cfg, seed=0, name="test", on_event=events.append)
    engine.events = events  # type: ignore[attr-defined]
    try:
        yield engine
    finally:
        engine.close()
