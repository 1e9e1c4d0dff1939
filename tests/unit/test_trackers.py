"""learner.trackers: rows written to TensorBoard and W&B and read back with their own readers, a resumed learner's
restart marker, a tracker that fails (for real: a file-size limit) leaving training alone, and a missing package
refused in one line."""

from __future__ import annotations

import errno
import json
import logging
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from pydantic import SecretStr

from common.config import Config, ConfigError
from common.transport import LeaseLost
from learner.trackers import TensorBoard, Trackers, check_trackers, open_trackers
from tests.conftest import REPO
from tests.tracker_files import (
    as_float32,
    expected_series,
    offline_runs,
    tensorboard_scalars,
    wandb_env,
    wandb_history,
    wandb_records,
    wandb_run,
)

# Rows as the learner writes them: step 0 has only the evaluation; a step whose updates were all skipped has a NaN
# loss (null in metrics.jsonl); values of many magnitudes, and an int.
ROWS = [
    {"step": 0, "policy_version": 0, "eval/accuracy": 0.25, "time/eval_s": 1.5},
    {"step": 1, "policy_version": 1, "reward": 0.5, "loss": 0.123456789012345, "clip_ratio/low_mean": 0.0,
     "groups_consumed": 8, "lr": 1e-6, "time/step_s": 3.25e-3},
    {"step": 2, "policy_version": 2, "reward": 0.75, "loss": float("nan"), "clip_ratio/low_mean": 0.015625,
     "groups_consumed": 16, "lr": 2e-6, "time/step_s": 12345.678, "updates_skipped_nonfinite": 2},
]  # fmt: skip


def config(run_dir: Path, *trackers: str) -> Config:
    cfg = Config()
    cfg.run.dir, cfg.run.name, cfg.run.trackers = str(run_dir), "tracked", list(trackers)  # type: ignore[assignment]
    return cfg


def test_tensorboard_holds_every_number_of_every_row_at_its_step(tmp_path: Path) -> None:
    trackers = open_trackers(config(tmp_path, "tensorboard"), "0123456789abcdef", first_step=0)
    assert trackers.names == ["tensorboard"]
    for row in ROWS:
        trackers.log(row)
    trackers.close()
    got = tensorboard_scalars(tmp_path / "tensorboard")
    # Written out by hand: the step is the x axis; the NaN loss of step 2 is not there.
    assert got["loss"] == [(1, pytest.approx(0.123456789012345, rel=1e-7))]
    assert got["groups_consumed"] == [(1, 8.0), (2, 16.0)]
    assert got["eval/accuracy"] == [(0, 0.25)] and "step" not in got
    assert got == as_float32(expected_series(ROWS))  # exactly, at 32 bits


def test_a_resumed_learner_replaces_what_an_earlier_attempt_wrote_after_the_checkpoint(tmp_path: Path) -> None:
    """First attempt: steps 0-4, then it dies; its checkpoint was step 2. The resumed learner writes steps 3-5 (new
    values): TensorBoard shows each step once, the resumed learner's values from step 3 on."""
    directory = tmp_path / "tensorboard"
    first = Trackers([TensorBoard(directory, 0)])
    for step in range(5):
        first.log({"step": step, "reward": float(step)})
    first.close()
    second = Trackers([TensorBoard(directory, 3)])
    for step in range(3, 6):
        second.log({"step": step, "reward": 10.0 + step})
    second.close()
    assert len(list(directory.iterdir())) == 2
    assert tensorboard_scalars(directory) == {"reward": [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]}


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key, value in wandb_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    import wandb

    yield
    wandb.teardown()  # its service process, started by the run, ends with the test


def test_wandb_offline_run_holds_every_number_of_every_row(tmp_path: Path, offline_wandb: None) -> None:
    cfg = config(tmp_path / "run", "wandb")
    cfg.redis.password = SecretStr("not-for-wandb")
    trackers = open_trackers(cfg, "0123456789abcdef", first_step=0)
    assert trackers.names == ["wandb"]
    for row in ROWS:
        trackers.log(row)
    trackers.close()
    [run_file] = offline_runs(tmp_path / "run")
    records = wandb_records(run_file)
    assert wandb_history(records) == expected_series(ROWS)  # exactly: W&B keeps doubles
    run = wandb_run(records)
    assert (run.run_id, run.project, run.display_name) == ("0123456789abcdef", "grpo-pipeline", "tracked")
    config_keys = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config_keys["run"]["trackers"] == ["wandb"] and config_keys["redis"]["password"] is None
    assert b"not-for-wandb" not in run_file.read_bytes()


class Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.steps: list[int] = []

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.steps.append(step)

    def close(self) -> None:
        pass


class DiskFull(Recorder):
    name = "full"

    def log(self, values: Mapping[str, float], step: int) -> None:
        if step >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        super().log(values, step)


def test_a_failing_tracker_warns_once_and_the_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    full, recorder = DiskFull(), Recorder()
    trackers = Trackers([full, recorder])
    with caplog.at_level(logging.WARNING, "learner"):
        for step in range(5):
            trackers.log({"step": step, "reward": 0.5})
    assert full.steps == [0, 1] and recorder.steps == [0, 1, 2, 3, 4]
    assert trackers.names == ["recorder"]
    [warning] = caplog.messages
    assert "tracker full failed at step 2" in warning and "No space left on device" in warning
    assert "training goes on and metrics.jsonl has every row" in warning


class Fenced(Recorder):
    """A tracker's call during which the learner's lease thread found the run lost (it raises LeaseLost in the
    training loop wherever that is: here, inside the tracker's library)."""

    name = "fenced"

    def log(self, values: Mapping[str, float], step: int) -> None:
        if step >= 1:
            raise LeaseLost("this learner no longer holds the run (the run is held by lease token 2)")
        super().log(values, step)


def test_a_lost_lease_inside_a_tracker_stops_the_learner(caplog: pytest.LogCaptureFixture) -> None:
    fenced, recorder = Fenced(), Recorder()
    trackers = Trackers([recorder, fenced])
    trackers.log({"step": 0, "reward": 0.5})
    with caplog.at_level(logging.WARNING, "learner"), pytest.raises(LeaseLost, match="lease token 2"):
        trackers.log({"step": 1, "reward": 0.5})
    assert not caplog.messages  # not a tracker's failure, reported and left behind: the learner stops (exit 5)
    assert trackers.names == ["recorder", "fenced"]


def test_a_full_disk_under_tensorboard_is_one_warning_and_the_rows_go_on(tmp_path: Path) -> None:
    """For real: the event file may not grow past 4 KiB (RLIMIT_FSIZE; a write past it fails with EFBIG, as a full
    disk fails with ENOSPC). Every row's call returns; one warning; the rows written before it read back whole."""
    script = textwrap.dedent(
        """
        import logging, resource, signal, sys
        from pathlib import Path
        from learner.trackers import TensorBoard, Trackers

        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
        trackers = Trackers([TensorBoard(Path(sys.argv[1]), 0)])
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        for step in range(20):
            trackers.log({"step": step, **{f"figure/{i}": i + step / 100 for i in range(20)}})
        print("rows done; trackers left:", trackers.names)
        """
    )
    directory = tmp_path / "tensorboard"
    out = subprocess.run([sys.executable, "-c", script, str(directory)], cwd=REPO, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "rows done; trackers left: []"
    [warning] = [line for line in lines if line.startswith("WARNING")]
    assert "tracker tensorboard failed at step" in warning and "File too large" in warning
    got = tensorboard_scalars(directory)
    steps = [s for s, _ in got["figure/0"]]
    assert 1 <= len(steps) < 20 and steps == list(range(len(steps)))
    assert all([s for s, _ in points] == steps for points in got.values())


def test_a_tracker_that_cannot_start_is_left_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "tensorboard").write_text("a file where the event directory would go")
    with caplog.at_level(logging.WARNING, "learner"):
        trackers = open_trackers(config(tmp_path, "tensorboard"), "0123456789abcdef", first_step=0)
    assert trackers.names == []
    trackers.log(ROWS[0])  # nothing to write to, nothing raised
    [warning] = caplog.messages
    assert warning.startswith("tracker tensorboard could not start (FileExistsError")
    assert "training goes on without it; metrics.jsonl has every row" in warning


@pytest.mark.parametrize("name, module", [("tensorboard", "tensorboard.compat.proto.event_pb2"), ("wandb", "wandb")])
def test_a_missing_package_is_one_line_naming_the_key_and_the_extra(
    name: str, module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # `import` of it now raises ImportError, as when not installed
    with pytest.raises(ConfigError) as e:
        check_trackers(["tensorboard", "wandb"])
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"config error: run.trackers: {name} needs a package that is not installed")
    assert f"pip install 'grpo-pipeline[{name}]'" in message


def test_without_trackers_neither_library_is_imported() -> None:
    script = (
        "import sys; from common.config import Config; from learner.trackers import check_trackers, open_trackers; "
        "check_trackers([]); open_trackers(Config(), '', 0).log({'step': 0, 'reward': 1.0}); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorboard', 'wandb')))"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
