"""metrics.jsonl as the learner writes and reads it back: strict JSON, and only a torn last row forgiven."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from common.storage import StorageError
from learner.record import _json_row, metrics_rows


def test_non_finite_figures_are_written_as_null() -> None:
    line = _json_row({"step": 3, "loss": math.inf, "grad_norm": math.nan, "lr": 1e-3, "note": "x"})
    assert json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in {line}")) == {
        "step": 3, "loss": None, "grad_norm": None, "lr": 1e-3, "note": "x",
    }  # fmt: skip


def test_a_torn_last_row_is_left_out_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    text = '{"step": 0}\n{"step": 1}\n{"step": 2, "rew'
    with caplog.at_level(logging.WARNING, logger="learner"):
        assert metrics_rows(text, tmp_path / "metrics.jsonl") == ['{"step": 0}', '{"step": 1}']
    assert "line 3" in caplog.text and "cut short" in caplog.text


def test_a_damaged_row_before_the_last_is_one_line_naming_it(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match=r"metrics\.jsonl: line 2 is not JSON"):
        metrics_rows('{"step": 0}\n{"step": 1, "rew\n{"step": 2}\n', tmp_path / "metrics.jsonl")
