"""Which policy version produced which tokens of each completion (``actor.weight_updates: in_flight``): part of the
group message (common.schemas.group), optional since schema version 4.

An actor that loads a new version while its answers are still being sampled ends with answers whose first tokens
came from one version and the rest from a newer one. Each completion then carries its tokens' versions run-length
encoded, oldest first: ``(version, tokens)`` pairs whose token counts add up to its length and whose versions rise.
On the wire, one optional map inside ``completions``::

    "versions": {"runs": array (G,), "version": array (R,), "tokens": array (R,)}

``runs[i]`` is how many runs completion ``i`` has (R = Σ runs), then each run's version and token count, completion
after completion. The group's ``policy_version`` is the newest version any of its tokens holds: admission and the
group's staleness go by it, and each token's own age is the group's plus how far its version is behind that one.
Absent (every earlier message, and every group whose tokens all came from its ``policy_version``), every token is
``policy_version``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from common.schemas.fields import SchemaError

INT32 = np.dtype(np.int32)


class VersionRuns:
    """The runs of a group's G completions as three columns (see the module's docstring)."""

    __slots__ = ("counts", "tokens", "versions")

    def __init__(self, counts: np.ndarray, versions: np.ndarray, tokens: np.ndarray):
        self.counts = counts  # int32 (G,): runs per completion, each >= 1
        self.versions = versions  # int32 (R,)
        self.tokens = tokens  # int32 (R,): tokens per run, each >= 1

    @classmethod
    def of(cls, runs: Sequence[np.ndarray | None], lengths: np.ndarray, version: int | None) -> VersionRuns | None:
        """From each completion's ``(k, 2)`` array of (version, tokens) rows, or None for one whose tokens are all
        ``version``'s; None when every token is ``version``'s (nothing to send)."""
        if all(r is None for r in runs):
            return None
        if version is None:  # (a Completions built without its message: every completion must say)
            version = max(int(r[:, 0].max()) for r in runs if r is not None)
        rows = [
            np.array([[version, n]], dtype=INT32) if r is None else np.asarray(r, dtype=INT32).reshape(-1, 2)
            for r, n in zip(runs, lengths.tolist(), strict=True)
        ]
        both = np.concatenate(rows)
        if len(both) == len(rows) and (both[:, 0] == version).all():
            return None
        return cls(np.array([len(r) for r in rows], dtype=INT32), both[:, 0].copy(), both[:, 1].copy())

    @property
    def offsets(self) -> np.ndarray:
        """int64 (G + 1,): completion i's runs are ``[offsets[i], offsets[i + 1])``."""
        out = np.zeros(len(self.counts) + 1, dtype=np.int64)
        np.cumsum(self.counts, out=out[1:])
        return out

    def completion(self, i: int) -> np.ndarray:
        """Completion ``i``'s runs as a ``(k, 2)`` array of (version, tokens)."""
        a, b = self.offsets[i : i + 2].tolist()
        return np.stack([self.versions[a:b], self.tokens[a:b]], axis=1)

    def token_versions(self) -> np.ndarray:
        """int64 (N,): every token's version, completion after completion (the layout of ``token_ids``)."""
        return np.repeat(self.versions.astype(np.int64), self.tokens)

    def newest(self) -> int:
        return int(self.versions.max())

    def fields(self) -> dict[str, np.ndarray]:
        return {"runs": self.counts, "version": self.versions, "tokens": self.tokens}


VERSION_KEYS = {"runs", "version", "tokens"}


def check_runs(runs: VersionRuns, lengths: np.ndarray, policy_version: int) -> None:
    """Runs that describe the completions exactly: as many run counts as completions, each >= 1 and together the
    number of runs; every run at least one token and a version >= 0; each completion's runs adding up to its length
    with versions rising; and the newest version the group's ``policy_version``."""
    g, r = len(lengths), len(runs.versions)
    if len(runs.counts) != g:
        raise SchemaError(f"completions.versions: {len(runs.counts)} run counts for {g} completions")
    if len(runs.tokens) != r:
        raise SchemaError(f"completions.versions: {r} versions but {len(runs.tokens)} token counts")
    if runs.counts.min() < 1 or int(runs.counts.sum(dtype=np.int64)) != r:
        raise SchemaError(f"completions.versions: run counts must be >= 1 and add up to the {r} runs")
    if runs.tokens.min() < 1 or runs.versions.min() < 0:
        raise SchemaError("completions.versions: every run has at least one token and a version >= 0")
    starts = runs.offsets[:-1]
    sums = np.add.reduceat(runs.tokens.astype(np.int64), starts)
    if (bad := np.flatnonzero(sums != lengths)).size:
        i = int(bad[0])
        raise SchemaError(f"completions[{i}].versions: runs of {int(sums[i])} tokens for {int(lengths[i])}")
    rising = np.diff(runs.versions.astype(np.int64)) > 0
    rising[starts[1:] - 1] = True  # a completion's first run may be older than the one before it
    if not rising.all():
        i = int(np.searchsorted(runs.offsets, int(np.flatnonzero(~rising)[0]) + 1, side="right")) - 1
        raise SchemaError(f"completions[{i}].versions: versions must rise within a completion")
    if runs.newest() != policy_version:
        raise SchemaError(f"completions.versions: the newest version {runs.newest()} is not policy_version "
                          f"{policy_version}")  # fmt: skip


def runs_from_fields(d: dict[str, Any], decode: Any) -> VersionRuns:
    """The ``versions`` map's arrays, decoded by the group module's array decoder ``decode(value, where)``."""
    where = "completions.versions."
    return VersionRuns(*(decode(d[k], where + k) for k in ("runs", "version", "tokens")))
