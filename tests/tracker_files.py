"""Reading back what the experiment trackers wrote, with the trackers' own formats: TensorBoard event files through
TensorBoard's reader, and the W&B offline run file (``run-<id>.wandb``) record by record. And the environment that
keeps W&B offline and inside a test's directory: it never reaches wandb.ai (nor its error reporting)."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

Series = dict[str, list[tuple[int, float]]]  # key -> (step, value) in the order written


def wandb_env(tmp: Path) -> dict[str, str]:
    """W&B offline, its caches and settings under ``tmp``; its server address a closed loopback port, so that
    anything that tried the network would fail here rather than go out."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_BASE_URL": "http://127.0.0.1:9",
        "WANDB_DIR": str(tmp / "wandb-dir"),
        "WANDB_CACHE_DIR": str(tmp / "wandb-cache"),
        "WANDB_CONFIG_DIR": str(tmp / "wandb-config"),
        "WANDB_DATA_DIR": str(tmp / "wandb-data"),
        "WANDB_API_KEY": "",
    }


def expected_series(rows: list[Mapping[str, Any]]) -> Series:
    """What a tracker must hold for these rows, written out independently of learner.trackers: every number of
    every row but ``step``, at the row's step (a null, or a number that is not finite, is left out)."""
    series: Series = {}
    for row in rows:
        for key, value in row.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if math.isfinite(value):
                series.setdefault(key, []).append((row["step"], float(value)))
    return series


def as_float32(series: Series) -> Series:
    """TensorBoard's scalars are 32-bit floats."""
    return {k: [(s, float(np.float32(v))) for s, v in points] for k, points in series.items()}


def tensorboard_scalars(directory: Path) -> Series:
    """Every scalar TensorBoard shows for the event files in ``directory`` (its own reader, all points kept)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _log_records(data: bytes) -> Iterator[bytes]:
    """The records of a W&B run file: a 7-byte header (``:W&B``, magic, version), then LevelDB's log format,
    blocks of 32 KiB whose records have a 7-byte header (CRC, length, type: full, first, middle, last)."""
    block = 32768
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), "not a W&B run file"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            parts = chunk
        elif kind == 3:
            parts += chunk
        elif kind == 4:
            yield parts + chunk


def wandb_records(run_file: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    records = []
    for data in _log_records(run_file.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        records.append(record)
    return records


def wandb_history(records: list[Any]) -> Series:
    """The logged values, by key, at their steps (W&B's own ``_step``, ``_runtime`` and ``_timestamp`` left out)."""
    series: Series = {}
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith("_"):
                series.setdefault(key, []).append((record.history.step.num, float(json.loads(item.value_json))))
    return series


def wandb_run(records: list[Any]) -> Any:
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")


def offline_runs(wandb_dir: Path) -> list[Path]:
    """The run files of the offline runs under ``<dir>/wandb``, oldest first."""
    return sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
