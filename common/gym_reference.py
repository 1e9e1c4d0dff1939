"""What a reasoning-gym problem's reference holds, in one place: the task writes it (common.tasks.gym) and the grader's
worker reads it (grader.gym). Where the problem came from — the dataset, its config, its seed and size, the item's
index — and a fingerprint of the question asked and its answer, so that the grader can tell an entry it
regenerates from another.

It imports nothing but the standard library: a grader worker process reads it without loading the config's libraries.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def fingerprint(entry: dict[str, Any]) -> str:
    """Of the entry's question and answer: an entry regenerated otherwise differs in one of them."""
    return hashlib.sha256(f"{entry['question']}\0{entry['answer']}".encode()).hexdigest()[:16]


def encode(dataset: str, config: dict[str, Any], seed: int, size: int, index: int, entry: dict[str, Any]) -> str:
    where = {"d": dataset, "c": config, "s": seed, "n": size, "i": index, "q": fingerprint(entry)}
    return json.dumps(where, sort_keys=True)


def decode(reference: str) -> dict[str, Any]:
    """The reference's fields (``d``, ``c``, ``s``, ``n``, ``i``, ``q``); ValueError when it is not one."""
    where = json.loads(reference)
    if not isinstance(where, dict) or set(where) != {"d", "c", "s", "n", "i", "q"}:
        raise ValueError(f"not a reasoning-gym reference: {reference[:200]!r}")
    return where
