"""The `grpo` command as an operator meets it: `grpo --help` and `--version`, `grpo config`, help in plain text, and
the mistakes that fail before anything starts (a device this machine lacks, a hub model that cannot be fetched)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points, version
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
COMMANDS = sorted({ep.name for ep in entry_points(group="grpo.commands")} | {"config"})


def grpo(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    environ = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd), "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "common.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=environ,
    )


def one_line(done: subprocess.CompletedProcess) -> str:
    """The single line a user's mistake prints on stderr (warnings aside), with exit code 2."""
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip() and " WARNING " not in line]
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_help_lists_every_command_with_one_line(tmp_path: Path) -> None:
    done = grpo("--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    listed = dict(re.findall(r"^  ([a-z][\w-]*)  +(\S.*)$", done.stdout, flags=re.MULTILINE))
    assert sorted(listed) == COMMANDS
    assert all(len(line) > 10 and "`" not in line for line in listed.values()), listed
    assert "make-tiny-model" in done.stdout and "--version" in done.stdout


def test_version_is_the_installed_distributions(tmp_path: Path) -> None:
    done = grpo("--version", cwd=tmp_path)
    assert done.returncode == 0 and done.stdout == f"grpo-pipeline {version('grpo-pipeline')}\n", done.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_help_of_every_command_is_plain_text(command: str, tmp_path: Path) -> None:
    done = grpo(command, "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert not re.search(r"``|:func:|:class:|`[^`]+`", done.stdout), done.stdout


def test_a_mistyped_command_suggests_the_nearest(tmp_path: Path) -> None:
    assert one_line(grpo("confg", cwd=tmp_path)) == "grpo: unknown command 'confg'; did you mean config?"


def test_config_prints_the_resolved_tree_without_secrets_and_runs_nothing(tmp_path: Path) -> None:
    env = {"GRPO_REDIS_PASSWORD": "hunter2", "GRPO_REDIS_URL": "redis://u:hunter2@127.0.0.1:1/0"}
    done = grpo("config", "-o", "learner.lr=0.001", "-o", "task.chat_template=off", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert "hunter2" not in done.stdout
    tree = yaml.safe_load(done.stdout)
    assert tree["learner"]["lr"] == 0.001 and tree["task"]["chat_template"] == "off"
    assert tree["redis"]["url"] == "redis://u:***@127.0.0.1:1/0" and tree["redis"]["password"] is None
    assert list(tmp_path.iterdir()) == []  # nothing written: no run directory
    # What it prints is a config file grpo takes as it is, giving the same tree.
    (tmp_path / "resolved.yaml").write_text(done.stdout)
    again = grpo("config", "--json", "--config", "resolved.yaml", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout) == tree


def test_config_files_merge_left_to_right(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text("run:\n  steps: 50\n  name: recipe\nlearner:\n  lr: 0.5\n")
    (tmp_path / "local.yaml").write_text("run:\n  name: mine\n")
    done = grpo("config", "--json", "--config", "base.yaml", "--config", "local.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    tree = json.loads(done.stdout)
    assert (tree["run"]["name"], tree["run"]["steps"], tree["learner"]["lr"]) == ("mine", 50, 0.5)


def test_config_keys_lists_every_key_of_the_reference_with_its_default(tmp_path: Path) -> None:
    done = grpo("config", "--keys", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0]: line.split(maxsplit=1)[1] for line in done.stdout.splitlines()}
    rows = re.findall(r"^\| `(\w+\.[\w.]+)` \| `?([^|`]*)`? \|", (REPO / "docs" / "configuration.md").read_text(), re.M)
    assert len(rows) > 100 and sorted(listed) == sorted(key for key, _ in rows)
    for key, default in rows:
        assert listed[key].startswith((default.strip() or "-") + "  "), key
    meanings = {line.split()[0]: line.split(maxsplit=2)[2] for line in done.stdout.splitlines()}
    assert meanings["run.steps"].startswith("learner steps (one batch of groups each)")
    assert meanings["task.chat_template"].endswith("one of 'auto', 'on', 'off'")


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["-o", "learner.lrr=1"], "grpo config: config error: learner.lrr: unknown key; did you mean learner.lr?"),
        (["-o", "lerner.lr=1"], "grpo config: config error: lerner: unknown key; did you mean learner?"),
        (["--config", "typo.yaml"], "grpo config: config error: learner.lrr: unknown key; did you mean learner.lr?"),
    ],
)
def test_a_mistyped_key_suggests_the_nearest(args: list[str], line: str, tmp_path: Path) -> None:
    (tmp_path / "typo.yaml").write_text("learner:\n  lrr: 0.1\n")
    assert one_line(grpo("config", *args, cwd=tmp_path)) == line


@pytest.mark.parametrize(
    ("option", "word"), [("learner.autocast", "off"), ("task.chat_template", "off"), ("task.chat_template", "on")]
)
def test_documented_choices_are_taken_as_written_on_the_command_line(option: str, word: str, tmp_path: Path) -> None:
    section, key = option.split(".")
    (tmp_path / "c.yaml").write_text(f"{section}:\n  {key}: {word}\n")
    for args in (["-o", f"{option}={word}"], ["--config", "c.yaml"]):
        done = grpo("config", "--json", *args, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)[section][key] == word


def _absent_devices() -> list[str]:
    import torch

    return ["cuda:99"] + ([] if torch.cuda.is_available() else ["cuda"])


@pytest.mark.parametrize("device", _absent_devices())
@pytest.mark.parametrize("command", ["run", "learner", "actor"])
def test_a_device_this_machine_lacks_is_one_line_before_anything_starts(
    command: str, device: str, tmp_path: Path
) -> None:
    # An unreachable Redis: the device is checked first, so it never matters.
    args = ["-o", f"model.device={device}", "-o", f"run.dir={tmp_path / 'run'}"]
    args += [] if command == "run" else ["-o", "redis.url=redis://127.0.0.1:1/0", "-o", "redis.retries=0"]
    line = one_line(grpo(command, *args, cwd=tmp_path))
    assert line.startswith(f"grpo {command}: config error: model.device: {device}: "), line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["run", "actor", "eval"])
def test_sglang_on_a_cpu_that_cannot_run_it_is_one_line_before_anything_starts(command: str, tmp_path: Path) -> None:
    """The CPU reported as one without AVX2 (common/hardware.py reads GRPO_CPU_FLAGS instead of /proc/cpuinfo):
    SGLang's server would die with Illegal instruction after minutes; instead one line names what the CPU lacks."""
    args = ["-o", "actor.engine=sglang", "-o", "sglang.device=cpu", "-o", f"run.dir={tmp_path / 'run'}"]
    args += ["-o", "redis.url=redis://127.0.0.1:1/0", "-o", "redis.retries=0"] if command == "actor" else []
    args += ["--model", str(tmp_path / "model")] if command == "eval" else []
    line = one_line(grpo(command, *args, cwd=tmp_path, env={"GRPO_CPU_FLAGS": "sse2 sse4_2 avx"}))
    assert line.startswith(f"grpo {command}: config error: actor.engine: sglang cannot run on this CPU: "), line
    assert "avx2" in line and "actor.engine=local" in line, line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["run", "learner", "actor"])
def test_a_hub_model_that_cannot_be_fetched_is_one_line(command: str, tmp_path: Path) -> None:
    args = ["-o", "model.path=no-such-org/no-such-model", "-o", f"run.dir={tmp_path / 'run'}"]
    args += [] if command == "run" else ["-o", "redis.url=redis://127.0.0.1:1/0", "-o", "redis.retries=0"]
    line = one_line(grpo(command, *args, cwd=tmp_path, timeout=60))
    assert line.startswith(f"grpo {command}: config error: model.path: no-such-org/no-such-model "), line


def test_a_hub_that_cannot_be_reached_is_one_line_in_seconds(tmp_path: Path) -> None:
    """Online, with the hub unreachable (its address a closed loopback port): one try, one line, exit 2 — not
    transformers' minute of retries in every process and its traceback."""
    from common.ports import free_port

    env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}", "HF_HOME": str(tmp_path / "hf")}
    args = ["-o", "model.path=no-such-org/no-such-model", "-o", f"run.dir={tmp_path / 'run'}"]
    line = one_line(grpo("run", *args, cwd=tmp_path, env=env, timeout=60))
    assert line.startswith("grpo run: config error: model.path: cannot fetch no-such-org/no-such-model from the "), line
    assert not (tmp_path / "run").exists()
