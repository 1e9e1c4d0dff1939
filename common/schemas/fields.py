"""What every form of the wire package (common.schemas) checks its fields with, and the error they all raise."""

from __future__ import annotations

import json
import math
from typing import Any

_MAX_ID_LEN = 256


class SchemaError(ValueError):
    """A message that does not decode or validate. ``str(err)`` is the reason recorded in the dead-letter stream."""


def as_text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def keys_of(d: Any, where: str, required: set[str]) -> dict[str, Any]:
    if type(d) is dict and d.keys() == required:  # the common case, without building sets
        return d
    if not isinstance(d, dict):
        raise SchemaError(f"{where}: expected a map, got {type(d).__name__}")
    keys = set(d)
    if missing := required - keys:
        raise SchemaError(f"{where}: missing {sorted(missing)}")
    if extra := keys - required:
        raise SchemaError(f"{where}: unknown keys {sorted(map(str, extra))}")
    return d


def integer(v: Any, where: str, lo: int = 0, hi: int = 1 << 53) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise SchemaError(f"{where}: expected an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise SchemaError(f"{where}: {v} outside [{lo}, {hi}]")
    return v


def number(v: Any, where: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise SchemaError(f"{where}: expected a number, got {type(v).__name__}")
    f = float(v)
    if not math.isfinite(f) or not lo <= f <= hi:
        raise SchemaError(f"{where}: {f} is not finite in [{lo}, {hi}]")
    return f


def text(v: Any, where: str, allow_empty: bool = False) -> str:
    if not isinstance(v, str):
        raise SchemaError(f"{where}: expected a string, got {type(v).__name__}")
    if (not v and not allow_empty) or len(v) > _MAX_ID_LEN:
        raise SchemaError(f"{where}: length {len(v)} outside [1, {_MAX_ID_LEN}]")
    return v


def boolean(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise SchemaError(f"{where}: expected a boolean, got {type(v).__name__}")
    return v


def json_map(raw: bytes | str, where: str) -> dict[str, Any]:
    """A JSON object (a Redis value one process wrote for another), or SchemaError naming ``where``."""
    try:
        d = json.loads(raw)
    except (ValueError, TypeError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise SchemaError(f"{where}: not JSON ({type(e).__name__}: {str(e)[:120]})") from None
    if not isinstance(d, dict):
        raise SchemaError(f"{where}: expected a JSON object, got {type(d).__name__}")
    return d
