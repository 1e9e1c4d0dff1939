"""The pure pieces of benchmarks/: learning curves from metrics.jsonl rows, time to target, and the PNG plots (decoded,
at their size, with the colours of the series they were given)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

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


def test_the_area_under_accuracy_holds_each_evaluation_until_the_next() -> None:
    c = {"eval_seconds": [0.0, 10.0, 20.0], "accuracy": [0.2, 0.4, 0.6]}
    assert curves.mean_accuracy(c, 20.0) == pytest.approx((0.2 * 10 + 0.4 * 10) / 20)
    assert curves.mean_accuracy(c, 15.0) == pytest.approx((0.2 * 10 + 0.4 * 5) / 15)
    assert curves.mean_accuracy(c, 30.0) == pytest.approx((2 + 4 + 0.6 * 10) / 30)  # the last one holds on
    assert curves.mean_accuracy(c, 0.0) == 0.2


def b2_run(kind: str, seed: int, seconds: float, ttt: float | None, auc: float) -> dict[str, Any]:
    return {"kind": kind, "seed": seed, "completions_per_s": 64 / seconds, "completions_sampled_per_s": 640 / seconds,
            "time_to_target_s": ttt, "accuracy_auc_mean": auc}  # fmt: skip


def test_b2_ratios_are_per_seed_with_their_median_and_the_worst_seed_held_to_its_goal() -> None:
    import versus_trl

    setting = versus_trl.SETTINGS["headroom"]
    assert setting.target_for(0) == pytest.approx(dict(setting.baseline)[0] + 0.20)
    ours = [b2_run("project", 0, 10, 20, 0.5), b2_run("project", 1, 10, 30, 0.5), b2_run("project", 2, 10, 40, 0.5)]
    theirs = [b2_run("trl", 0, 20, 50, 0.4), b2_run("trl", 1, 20, 100, 0.4), b2_run("trl", 2, 20, 100, 0.5)]
    r = versus_trl._ratios(setting, ours, theirs)
    assert [s["time_to_target_ratio"] for s in r["per_seed"]] == [0.4, 0.3, 0.4]
    assert r["time_to_target_ratio"] == 0.4 and r["completions_per_s_ratio"] == 2.0
    assert r["accuracy_auc_ratio"] == pytest.approx(1.25) and r["ok"] is True
    ours[0]["time_to_target_s"] = 45  # one seed at 0.9 of TRL's time: the median holds, the worst seed does not
    assert versus_trl._ratios(setting, ours, theirs)["ok"] is False
    ours[0]["time_to_target_s"] = None  # a seed that never reached the target fails the goal too
    assert versus_trl._ratios(setting, ours, theirs)["ok"] is False


def colours(png: Path) -> Any:
    """The distinct RGB colours of ``png``, decoded, and its size."""
    import numpy as np
    from PIL import Image

    with Image.open(png) as image:
        return np.unique(np.asarray(image.convert("RGB")).reshape(-1, 3).astype(int), axis=0), image.size


def near(found: Any, rgb: tuple[int, int, int], within: int = 30) -> bool:
    """Some colour of ``found`` close to ``rgb``: anti-aliasing blends a line's edges with the background."""
    import numpy as np

    return bool((np.abs(found - np.array(rgb)).sum(axis=1) <= within).any())


BLUE, ORANGE, RED, GREY = (31, 119, 180), (255, 127, 14), (214, 39, 40), (128, 128, 128)


def test_plots_write_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the bench extra (matplotlib) is not installed")
    b1 = {"cases": [{"g_over_t": r, "g_s": 0.4 * r, "t_s": 0.4, "sync_s_per_step": 0.4 + 0.4 * r,
                     "async_s_per_step": max(0.4, 0.4 * r)} for r in (0.25, 1, 4)]}  # fmt: skip
    b5 = {"cases": [{"actors": k, "groups_per_s": 4.0 * k, "ideal_groups_per_s": 4.0 * k} for k in (1, 2, 4)]}
    run = {"seed": 0, "synchronous": False, "seconds": [1, 2], "reward": [0.3, 0.9], "eval_seconds": [0, 2],
           "accuracy": [0.0, 1.0]}  # fmt: skip
    pair = [{**run, "kind": "async"}, {**run, "kind": "sync", "synchronous": True}]
    demo = {"target_reward": 0.9, "runs": [{**run, "kind": "demo"}, *pair]}
    # Each figure at its size (inches x 90 dpi), drawn in the colours its series are given: synchronous bars in the
    # first colour of matplotlib's cycle and asynchronous ones in the second; the ideal scaling grey beside the
    # measured line; the demo's seed in the cycle's first colour and the synchronous run red (text and axes are black
    # anywhere, so black proves nothing).
    expected = {
        plots.overlap: (b1, (540, 360), [BLUE, ORANGE]),
        plots.scale: (b5, (540, 360), [GREY, BLUE]),
        plots.curves: (demo, (990, 360), [BLUE, RED]),
    }
    for fn, (result, size, drawn) in expected.items():
        png = tmp_path / f"{fn.__name__}.png"
        assert fn(result, png)
        found, shape = colours(png)
        assert shape == size and len(found) > 2, (fn.__name__, shape, len(found))  # not blank, not one line only
        assert all(near(found, rgb) for rgb in drawn), fn.__name__
    # A series the plot was not given is not in it: the colour checks can fail.
    assert not near(colours(tmp_path / "scale.png")[0], RED)
