"""What a grader worker and its pool share: msgpack frames and the check of a grader's return value.

Kept apart from :mod:`grader.session` so that the worker process imports only this, the graders and what the graders
themselves need (the standard library and msgpack), never the learner's or the actor's libraries (torch).
"""

from __future__ import annotations

import math
import struct
from typing import Any

import msgpack

from common.rollout import GraderErrorKind  # (torch-free: the worker process may import it)

HEADER = struct.Struct(">I")


def write_frame(stream: Any, obj: Any) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    stream.write(HEADER.pack(len(body)) + body)
    stream.flush()


def read_frame_blocking(stream: Any) -> Any | None:
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (n,) = HEADER.unpack(header)
    body = stream.read(n)
    return msgpack.unpackb(body, raw=False) if len(body) == n else None


def check_score(value: Any) -> float:
    """A grader's return value as a reward, or ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"grader returned {value!r}, not a finite number")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"grader returned {value}, outside [0, 1]")
    return float(value)


def score_one(fn: Any, completion: str, reference: str) -> tuple[float, GraderErrorKind | None]:
    """(score, None), or (0.0, error kind) when the grader raises (``memory`` past the worker's memory limit) or
    returns a non-reward."""
    try:
        value = fn(completion, reference)
    except MemoryError:
        return 0.0, "memory"
    except Exception:
        return 0.0, "exception"
    try:
        return check_score(value), None
    except ValueError:
        return 0.0, "invalid"


def run_tool(fn: Any, call: str, max_chars: int) -> tuple[str | None, GraderErrorKind | None]:
    """(result text, None), cut to ``max_chars``; or (None, error kind) when the tool raises (``memory`` past the
    worker's memory limit) or returns something other than text."""
    try:
        value = fn(call)
    except MemoryError:
        return None, "memory"
    except Exception:
        return None, "exception"
    if not isinstance(value, str):
        return None, "invalid"
    return value[:max_chars], None
