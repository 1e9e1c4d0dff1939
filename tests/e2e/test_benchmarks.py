"""The benchmark scripts keep working, each small, on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_learner_throughput_runs_the_real_trainer() -> None:
    cmd = [sys.executable, str(REPO / "benchmarks" / "learner_throughput.py"), "--preset", "tiny", "--device", "cpu",
           "--dtype", "float32", "--steps", "2", "--groups", "4", "--group-size", "4", "--prompt-len", "16",
           "--completion-len", "32", "--peak-tflops", "1"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["tokens_per_step"] == 4 * 4 * (16 + 32) and report["tokens_per_s"] > 0
    assert 0 < report["mfu"] < 1


@pytest.mark.parametrize("script", ["transport.py", "weights.py"])
def test_b3_and_b4_measure_both_paths_in_one_run(script: str) -> None:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--quick"], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    cases = report.get("cases", [report])
    for case in cases:  # figures, not verdicts: the goals are checked by reading them, on a quiet machine
        assert case["ratio"] > 0 and case["goal"] == 0.5


def test_b4_broadcast_measures_the_disk_and_nccl_paths_to_several_actors() -> None:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "broadcast.py"), "--quick"], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert [c["receivers"] for c in report["cases"]] == [1, 2] and report["backend"] == "gloo"
    for case in report["cases"]:
        assert case["disk_s"] > 0 and case["broadcast_s"] > 0 and case["ratio"] > 0


def test_b1_runs_the_pipeline_synchronously_and_asynchronously() -> None:
    cmd = [sys.executable, str(REPO / "benchmarks" / "overlap.py"), "--ratios", "1", "--steps", "5"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    (case,) = json.loads(done.stdout.strip().splitlines()[-1])["cases"]
    assert case["ideal_speedup"] == 2.0 and case["sync_s_per_step"] > 0 and case["async_s_per_step"] > 0
    # actor.synchronous: every round is sampled with the weights of the step before it is trained.
    assert case["sync_staleness_max"] == 0


def test_b5_and_the_runner_write_one_report(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "report.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "run.py"), "--quick", "--only", "B4", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"B4"} and report["quick"] and "B4 weights" in done.stdout
    cmd = [sys.executable, str(REPO / "benchmarks" / "scale.py"), "--actors", "1", "2", "--seconds", "4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    cases = json.loads(done.stdout.strip().splitlines()[-1])["cases"]
    assert [c["actors"] for c in cases] == [1, 2] and cases[0]["ratio"] == 1.0 and cases[1]["groups_per_s"] > 0


def test_b2_trains_the_project_and_trl_on_the_same_problems(tmp_path) -> None:  # type: ignore[no-untyped-def]
    png = tmp_path / "b2.png"
    cmd = [sys.executable, str(REPO / "benchmarks" / "versus_trl.py"), "--quick", "--steps", "3", "--png", str(png)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    project, trl = report["runs"]
    assert (project["kind"], trl["kind"]) == ("project", "trl")
    for r in (project, trl):  # three steps each, every completion of a batch counted, step 0 and the last evaluated
        assert r["steps"] == 3 and r["completions"] == 3 * 256 and r["completions_per_s"] > 0
        assert all(0.0 <= x <= 1.0 for x in r["reward"]) and len(r["accuracy"]) == 2
    assert report["completions_per_s_ratio"] > 0 and png.stat().st_size > 0
