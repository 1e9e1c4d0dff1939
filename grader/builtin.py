"""Reward functions: ``(completion, reference) -> float`` in [0, 1]. Pure, no I/O; time limits live in grader.pool."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from grader.gym import reasoning_gym  # noqa: F401 - a built-in grader (grader.GRADERS) kept in a module of its own


def addition(completion: str, reference: str) -> float:
    """The demo task: 1 when the completion is exactly the answer (``"8"`` for ``"3+5="``), no spaces, nothing else.

    That the completion ended with end-of-sequence is checked by the caller (``task.require_stop``), which knows the
    finish reason; the text alone cannot tell "8<eos>" from "8" cut off at the length limit.
    """
    return 1.0 if completion == reference else 0.0


def exact(completion: str, reference: str) -> float:
    """Equal after stripping surrounding whitespace."""
    return 1.0 if completion.strip() == reference.strip() else 0.0


# --- GSM8K ------------------------------------------------------------------------------------------------------

_NUMBER = r"-?[$€£]?\s*\d[\d,]*(?:\.\d+)?"
_MARKERS = (
    re.compile(r"####\s*(" + _NUMBER + ")"),
    re.compile(r"\\boxed\{\s*(" + _NUMBER + r")\s*\}"),
    re.compile(r"answer is[:\s]*(" + _NUMBER + ")", re.IGNORECASE),
)
_ANY_NUMBER = re.compile(_NUMBER)
# A megabyte of digits must not cost seconds: only the tail of a completion can hold its final answer.
_MAX_SCAN = 20_000


def normalise_number(text: str) -> Decimal | None:
    """``"$1,234.00"`` → ``Decimal("1234")``; None when it is not a number."""
    cleaned = re.sub(r"[\s,$€£]", "", text).rstrip(".")
    if not cleaned or len(cleaned) > 100:
        return None
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value.normalize() if value.is_finite() else None


def gsm8k_final_answer(completion: str) -> Decimal | None:
    """Explicit markers first (``#### N``, ``\\boxed{N}``, "the answer is N"; the last of the first kind found),
    then the completion's last number."""
    tail = completion[-_MAX_SCAN:]
    for marker in _MARKERS:
        found = marker.findall(tail)
        if found:
            return normalise_number(found[-1])
    numbers = _ANY_NUMBER.findall(tail)
    return normalise_number(numbers[-1]) if numbers else None


def gsm8k(completion: str, reference: str) -> float:
    """The reference is a GSM8K answer whose last line is ``#### N``."""
    ref_text = reference.rsplit("####", 1)[-1] if "####" in reference else reference
    ref = normalise_number(ref_text.strip())
    got = gsm8k_final_answer(completion)
    return 1.0 if ref is not None and got is not None and got == ref else 0.0


# --- math (math-verify) ------------------------------------------------------------------------------------------


def math(completion: str, reference: str) -> float:
    """Symbolic equivalence through ``math-verify`` (fractions, LaTeX, sets, intervals)."""
    from math_verify import parse, verify  # imported on first use: it pulls in sympy

    gold = parse(reference if "$" in reference or "\\" in reference else f"${reference}$")
    answer = parse(completion[-_MAX_SCAN:])
    if not gold or not answer:
        return 0.0
    return 1.0 if verify(gold, answer) else 0.0


# --- patterns -----------------------------------------------------------------------------------------------------

# DeepSeek-R1's layout: reasoning in <think>, then the answer in <answer>.
DEFAULT_FORMAT = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"


def regex(completion: str, reference: str, *, pattern: re.Pattern[str]) -> float:
    """The answer is the first group of the pattern's last match in the completion; 1 when it equals the reference
    (both stripped), 0 when it differs or nothing matches."""
    found = pattern.findall(completion[-_MAX_SCAN:])
    if not found:
        return 0.0
    last = found[-1]
    answer = last[0] if isinstance(last, tuple) else last
    return 1.0 if answer.strip() == reference.strip() else 0.0


def format_match(completion: str, reference: str, *, pattern: re.Pattern[str]) -> float:
    """1 when the whole completion has the configured layout (``DEFAULT_FORMAT`` unless set); the reference is
    not used. Usually one weighted part of a ``combine`` grader."""
    return 1.0 if pattern.fullmatch(completion) else 0.0
