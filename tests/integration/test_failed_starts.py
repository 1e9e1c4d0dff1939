"""A start refused on the user's input leaves the run directory as it found it: `grpo run` checks the task, the model
and Redis before it touches the directory (no empty directory, no previous run renamed aside for nothing), and
`grpo learner` removes the directory it made when it is refused before training. Through the real CLI."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import load_config
from common.ports import free_port
from ops.launcher import Run

pytestmark = pytest.mark.integration


def grpo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "common.cli", *args], capture_output=True, text=True, timeout=120)


def previous_run(run_dir: Path) -> dict[str, str]:
    (run_dir / "logs").mkdir(parents=True)
    files = {"metrics.jsonl": '{"step": 0}\n', "logs/learner.log": "an earlier run\n"}
    for name, text in files.items():
        (run_dir / name).write_text(text)
    return files


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("mistake", ["model", "task", "redis"])
@pytest.mark.parametrize("before", ["nothing", "a previous run"])
def test_a_refused_grpo_run_leaves_the_run_dir_as_it_was(
    mistake: str, before: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    files = previous_run(run_dir) if before == "a previous run" else {}
    wrong = {
        "model": ["-o", f"model.path={tmp_path / 'no-such-model'}"],
        "task": ["-o", f"model.path={tiny_model_dir}", "-o", "task.name=dataset",
                 "-o", f"task.path={tmp_path / 'no-such.jsonl'}"],
        "redis": ["-o", f"model.path={tiny_model_dir}", "-o", f"redis.url=redis://127.0.0.1:{free_port()}/0",
                  "-o", "redis.retries=0"],
    }[mistake]  # fmt: skip
    done = grpo("run", "--plain", "-o", f"run.dir={run_dir}", *wrong)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("grpo run: "), done.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("run")) == (["run"] if files else [])
    if files:
        assert tree(run_dir) == files  # where it was, untouched


def test_a_start_that_fails_after_the_directory_puts_the_previous_run_back(tmp_path: Path) -> None:
    """Past the checks (a failure to start the private Redis, a Ctrl-C): what the start made goes, the previous
    run comes back; once a process of the run has started, its log is kept."""
    run_dir = tmp_path / "run"
    files = previous_run(run_dir)
    run = Run(load_config(None, [f"run.dir={run_dir}"]))
    run.prepare_dir()
    assert tree(run_dir) == {} and len(list(tmp_path.iterdir())) == 2  # the previous run renamed aside
    (run_dir / "config.json").write_text("{}")
    run.undo_dir()
    assert [p.name for p in tmp_path.iterdir()] == ["run"] and tree(run_dir) == files

    fresh = Run(load_config(None, [f"run.dir={tmp_path / 'fresh'}"]))
    fresh.prepare_dir()
    fresh.undo_dir()
    assert not (tmp_path / "fresh").exists()


def test_a_refused_learner_leaves_no_run_dir(redis_url: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    task = ["-o", "task.name=dataset", "-o", f"task.path={tmp_path / 'x.jsonl'}"]
    model = ["-o", f"model.path={tiny_model_dir}"]
    done = grpo("learner", "-o", f"redis.url={redis_url}", "-o", f"run.dir={run_dir}", *model, *task)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("grpo learner: config error: task.path"), done.stderr
    assert not run_dir.exists(), sorted(str(p) for p in run_dir.rglob("*"))


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://u:s3cret@redis.example:6379/0", "redis://u@redis.example:6379/0"),
        ("redis://:s3cret@redis.example:6379/0?password=s3cret&db=0", "redis://redis.example:6379/0?db=0"),
        ("redis://redis.example:6379/0", "redis://redis.example:6379/0"),
    ],
)
def test_actors_zero_with_an_external_redis_names_a_url_that_works_and_no_password(
    tmp_path: Path, url: str, shown: str
) -> None:
    """The printed command must work as printed: config.json holds the URL masked (``***``), so it passes the URL
    itself, without its password, which the actor takes from GRPO_REDIS_PASSWORD."""
    cfg = load_config(None, [f"redis.url={url}", f"run.dir={tmp_path / 'run'}", "run.actors=0"], env={})
    line = Run(cfg).actors_to_start()
    assert "s3cret" not in line
    assert f"-o redis.url={shlex.quote(shown)} " in line
    assert ("GRPO_REDIS_PASSWORD" in line) == (shown != url)
