"""The pure pieces of benchmarks/: learning curves from metrics.jsonl rows, time to target, and the PNG plots."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import curves
import plots


def test_curve_and_time_to_target() -> None:
    rows = [{"step": 0, "eval/accuracy": 0.0}] + [
        {"step": s, "time/step_s": 0.5, "reward": min(1.0, 0.2 * s), **({"eval/accuracy": 1.0} if s == 8 else {})}
        for s in range(1, 9)
    ]
    c = curves.curve(rows)
    assert c["seconds"] == [0.5 * s for s in range(1, 9)] and c["reward"][0] == pytest.approx(0.2)
    assert c["eval_seconds"] == [0.0, 4.0] and c["accuracy"] == [0.0, 1.0]
    # rewards 0.2, 0.4, 0.6, 0.8, 1, 1, 1, 1: the mean of the last 5 is 0.88 at step 7, 0.96 at step 8 (4.0 s)
    assert curves.time_to_target(c) == 4.0
    assert curves.time_to_target({"seconds": [1.0], "reward": [0.1]}) is None


def test_plots_write_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is not installed")
    b1 = {"cases": [{"g_over_t": r, "g_s": 0.4 * r, "t_s": 0.4, "sync_s_per_step": 0.4 + 0.4 * r,
                     "async_s_per_step": max(0.4, 0.4 * r)} for r in (0.25, 1, 4)]}  # fmt: skip
    b5 = {"cases": [{"actors": k, "groups_per_s": 4.0 * k, "ideal_groups_per_s": 4.0 * k} for k in (1, 2, 4)]}
    run = {"seed": 0, "synchronous": False, "seconds": [1, 2], "reward": [0.3, 0.9], "eval_seconds": [0, 2],
           "accuracy": [0.0, 1.0]}  # fmt: skip
    pair = [{**run, "kind": "async"}, {**run, "kind": "sync", "synchronous": True}]
    demo = {"target_reward": 0.9, "runs": [{**run, "kind": "demo"}, *pair]}
    for fn, result in ((plots.overlap, b1), (plots.scale, b5), (plots.curves, demo)):
        png = tmp_path / f"{fn.__name__}.png"
        assert fn(result, png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
