"""benchmarks/load.py, small: sim actors against a learner keep the stream and Redis's memory under their bounds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_load_script_stays_within_bounds(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "load.py"),
        "--actors",
        "3",
        "--seconds",
        "8",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "load.json").read_text())
    assert report["learner_steps"] > 0 and report["groups_trained_per_s"] > 0
    assert 0 < report["stream_length_max"] <= report["stream_bound"]
    assert report["redis_used_memory_max_mb"] <= report["redis_memory_bound_mb"]
    assert "(balanced)" in report["equation_after_stop"]
