"""The wire package's forms of the prompts' accounting (see common.schemas, its face): the counters of what became of
every prompt position drawn (fields ``prompts_*`` of the hash ``stats``) and an actor's claim on the positions of
the round it samples (a field of the hash ``prompts:claims``). The admission scripts (common.transport.admission)
write both inside the scripts that draw and settle positions; ``grpo status`` and the tests read them through here.

Every position an actor draws from the shared cursor is, at any moment, exactly one of: settled (its group sent, or
filtered, discarded or skipped, each by reason), held by a claim (a round being sampled), or waiting to be drawn
again (``prompts:redraw``, after its claim was given up or its actor died)::

    drawn = sent + Σ filtered + Σ discarded + Σ skipped + claimed + to_redraw

A sent position is one group of the groups' own equation (trained, dropped, dead, pending or unread); the learner
marks each trained position in the bitmap ``prompts:trained`` as it acknowledges its group, so that a position
trained twice within a pass (an epoch) is counted (``retrained``), never silent.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from common.schemas.fields import SchemaError, as_text

# What became of a position, by reason: ``filtered`` (its group kept back by a filter: zero_std), ``discarded``
# (sampled, never sent: stopped, run_done, oversized), ``skipped`` (never sampled: too_long, a prompt with no room
# for an answer; difficulty, passed over by difficulty sampling), ``requeued`` (given back to be drawn again: lost,
# its claim's lease ran out with its actor gone; released, an actor let a round go unsampled).
PromptKind = Literal["filtered", "discarded", "skipped", "requeued"]
PROMPT_KINDS: tuple[PromptKind, ...] = ("filtered", "discarded", "skipped", "requeued")
PROMPTS_DRAWN = "prompts_drawn"  # positions taken from the cursor
PROMPTS_SENT = "prompts_sent"  # positions whose group entered the stream (one group each)
PROMPTS_REDRAWN = "prompts_redrawn"  # positions taken again from prompts:redraw
PROMPTS_TRAINED = "prompts_trained"  # positions marked trained in prompts:trained (the learner's acknowledgement)
PROMPTS_RETRAINED = "prompts_retrained"  # positions acknowledged trained again within the same pass
_PLAIN = (PROMPTS_DRAWN, PROMPTS_SENT, PROMPTS_REDRAWN, PROMPTS_TRAINED, PROMPTS_RETRAINED)
# Difficulty sampling's pools of problems, by their recent groups (actor.difficulty): the ``<pool>`` of the fields
# ``taken:<pool>`` and ``passed:<pool>`` of the hash ``prompts:choices``, and the label values of
# grpo_actor_prompts_taken_total and grpo_actor_prompts_passed_total.
PromptPool = Literal["unseen", "informative", "solved", "unsolved", "flipping"]
# The largest position the trained bitmap marks (Redis's strings end at 512 MB, 2^32 bits): a run past it goes on,
# its positions beyond unmarked.
MAX_MARKED_POSITION = 2**32 - 1


def prompt_counter(kind: PromptKind, reason: str) -> str:
    """The ``stats`` field counting positions ``kind`` for ``reason``: ``prompts_<kind>:<reason>``."""
    if kind not in PROMPT_KINDS or not re.fullmatch(r"[a-z0-9_]{1,64}", reason):
        raise ValueError(f"no counter prompts_{kind}:{reason}")
    return f"prompts_{kind}:{reason}"


def is_prompt_field(name: str) -> bool:
    return name.startswith("prompts_")


@dataclass(frozen=True)
class PromptCounters:
    """The ``prompts_*`` fields of the ``stats`` hash, read (an absent field is 0); the other fields are
    :class:`common.schemas.RunCounters`'."""

    drawn: int = 0
    sent: int = 0
    redrawn: int = 0
    trained: int = 0
    retrained: int = 0
    filtered: dict[str, int] = field(default_factory=dict)
    discarded: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    requeued: dict[str, int] = field(default_factory=dict)

    @property
    def counted(self) -> bool:
        """Whether the run's actors count prompts at all (earlier builds did not)."""
        return bool(self.drawn or self.redrawn)

    def settled(self) -> int:
        return self.sent + sum(self.filtered.values()) + sum(self.discarded.values()) + sum(self.skipped.values())

    def to_hash(self) -> dict[str, int]:
        plain = dict(zip(_PLAIN, (self.drawn, self.sent, self.redrawn, self.trained, self.retrained), strict=True))
        by_reason = {prompt_counter(k, r): n for k in PROMPT_KINDS for r, n in getattr(self, k).items()}
        return {name: n for name, n in {**plain, **by_reason}.items() if n}

    @classmethod
    def from_counts(cls, counts: Mapping[str, int]) -> PromptCounters:
        """From the ``prompts_*`` fields of ``stats``, already read as counts (common.schemas.state)."""
        plain = {name: 0 for name in _PLAIN}
        by_kind: dict[str, dict[str, int]] = {k: {} for k in PROMPT_KINDS}
        for name, n in counts.items():
            if name in plain:
                plain[name] = n
            elif (m := re.fullmatch(r"prompts_(filtered|discarded|skipped|requeued):(.+)", name, re.S)) is not None:
                by_kind[m.group(1)][m.group(2)] = n
            # (another prompts_ field, a newer build's, is not this equation's)
        return cls(
            plain[PROMPTS_DRAWN], plain[PROMPTS_SENT], plain[PROMPTS_REDRAWN], plain[PROMPTS_TRAINED],
            plain[PROMPTS_RETRAINED], by_kind["filtered"], by_kind["discarded"], by_kind["skipped"],
            by_kind["requeued"],
        )  # fmt: skip


@dataclass(frozen=True)
class PromptClaim:
    """The positions a round holds (actor → hash ``prompts:claims``, field: the round's holder, as in ``inflight``
    → the other actors' draw script, which gives an expired claim's positions back to be drawn again, and ``grpo
    status``): ``<lease end ms> r<round> <positions>``, the end of the lease in milliseconds of Redis's clock, the
    hexadecimal token of the round that holds the claim (its draws and its write act on the claim only while it is
    that round's: a process started since under the same holder name has a round of its own), and the positions as
    comma-separated decimals or ``a-b`` ranges (both ends included). ``<lease end ms> <positions>``, a claim of an
    earlier build, reads as a round without a token (``round`` ''). Written, renewed and read inside the scripts of
    common.transport.prompts and common.transport.admission, which write exactly this form."""

    lease_end_ms: int
    positions: tuple[int, ...]
    round: str = ""

    def encode(self) -> str:
        token = f"r{self.round} " if self.round else ""
        return f"{self.lease_end_ms} {token}{','.join(_ranges(self.positions))}"

    @classmethod
    def decode(cls, raw: bytes | str) -> PromptClaim:
        text = as_text(raw)
        m = re.fullmatch(
            r"(\d{1,19}) (?:r([0-9a-f]{1,64}) ?)?((?:\d{1,19}(?:-\d{1,19})?)(?:,\d{1,19}(?:-\d{1,19})?)*)?", text
        )
        if m is None:
            raise SchemaError(f"prompt claim: {text[:60]!r} is not '<lease end ms> r<round> <positions>'")
        positions: list[int] = []
        for part in (m.group(3) or "").split(",") if m.group(3) else []:
            a, _, b = part.partition("-")
            lo, hi = int(a), int(b or a)
            if hi < lo or hi - lo > 1_000_000:
                raise SchemaError(f"prompt claim: range {part!r}")
            positions.extend(range(lo, hi + 1))
        return cls(int(m.group(1)), tuple(positions), m.group(2) or "")


def _ranges(positions: tuple[int, ...]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(positions):
        j = i
        while j + 1 < len(positions) and positions[j + 1] == positions[j] + 1:
            j += 1
        out.append(str(positions[i]) if i == j else f"{positions[i]}-{positions[j]}")
        i = j + 1
    return out


def claims_of(h: Mapping[Any, Any]) -> dict[str, PromptClaim]:
    """The hash ``prompts:claims``, read: holder → claim (SchemaError naming the holder for a malformed value)."""
    out: dict[str, PromptClaim] = {}
    for k, v in h.items():
        holder = as_text(k)
        try:
            out[holder] = PromptClaim.decode(v)
        except (SchemaError, UnicodeDecodeError) as e:
            raise SchemaError(f"prompts:claims.{holder[:80]}: {e}") from None
    return out
