"""Shared fixtures. Every process a test starts is stopped by PID at teardown, even when the test fails."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The demo model is built once per test session, in a private cache, never in the user's ~/.cache; datasets
    are cached there too, and the Hugging Face libraries never go online (tests talk to loopback only)."""
    cache = tmp_path_factory.mktemp("grpo-cache")
    settings = {
        "GRPO_CACHE_DIR": str(cache),
        "HF_DATASETS_CACHE": str(cache / "hf-datasets"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    old = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised tiny model (no warm start): fast, for engine and learner mechanics."""
    from ops.tiny_model import make_tiny_model

    path = tmp_path_factory.mktemp("tiny") / "model"
    make_tiny_model(path, warm=False)
    return path


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The warm-started demo model, exactly as `grpo run` builds it."""
    from ops.tiny_model import ensure_tiny_model

    return ensure_tiny_model(seed=0, eval_size=20)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[object]:
    """A real redis-server on a free loopback port, private to the test."""
    from ops.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: object) -> str:
    return redis_server.url  # type: ignore[attr-defined]


class Processes:
    """Processes a test started; all of them are stopped by PID at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        full_env = {**os.environ, **(env or {})}
        with log.open("ab") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=REPO)
        self.procs.append(proc)
        return proc

    def grpo(self, *args: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        return self.start([sys.executable, "-m", "common.cli", *args], log, env)

    def stop_all(self) -> None:
        from common.children import stop_process

        for proc in self.procs:
            stop_process(proc, grace_s=10)


@pytest.fixture
def processes() -> Iterator[Processes]:
    p = Processes()
    try:
        yield p
    finally:
        p.stop_all()


@pytest.fixture
def shared_dir() -> Path:
    value = os.environ.get("GRPO_SHARED_DIR")
    if not value or not Path(value).is_dir():
        pytest.skip("GRPO_SHARED_DIR is not set (the shared reference data is not on this machine)")
    return Path(value)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wrong_shaped_copy(good: Any, directory: Path, version: int, extra: int) -> Any:
    """A copy of the published version ``good`` whose ``model.norm.weight`` has ``extra`` more elements, with a
    digest that matches it: a version every check but the shapes passes (a real SGLang server dies loading it)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from common.schemas import WeightsAnnouncement
    from common.weights import digest

    shutil.copytree(good.uri, directory)
    state = load_file(str(directory / "model.safetensors"))
    state["model.norm.weight"] = torch.ones(state["model.norm.weight"].numel() + extra)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    checked, _ = digest(directory)
    (directory / "digest").write_text(checked + "\n")
    return WeightsAnnouncement(version=version, uri=str(directory), digest=checked)
