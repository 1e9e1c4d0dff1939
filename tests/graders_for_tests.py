"""Misbehaving graders, importable as ``tests.graders_for_tests:<name>`` by grader worker processes."""

from __future__ import annotations

import os
import time


def hang_on_x(completion: str, reference: str) -> float:
    if completion == "x":
        time.sleep(3600)
    return float(completion == reference)


def hang_while_file(completion: str, reference: str) -> float:
    """Exact match, but never returns while the file GRPO_TEST_HANG_FILE names exists: a grader call hung in the
    loop's thread of the process that grades inline (grader.isolation=inline), until the test removes it."""
    path = os.environ.get("GRPO_TEST_HANG_FILE", "")
    while path and os.path.exists(path):
        time.sleep(0.2)
    return float(completion == reference)


def boom_on_x(completion: str, reference: str) -> float:
    if completion == "x":
        raise RuntimeError("grader bug")
    return float(completion == reference)


def die_on_x(completion: str, reference: str) -> float:
    if completion == "x":
        os._exit(3)
    return float(completion == reference)


def out_of_range(completion: str, reference: str) -> float:
    return 2.0 if completion == "x" else float(completion == reference)


def prints(completion: str, reference: str) -> float:
    print("a grader that prints to stdout")
    return float(completion == reference)


# What a grader worker must not load: torch, and the project's modules that import it.
HEAVY_MODULES = ("torch", "transformers", "numpy", "common.model.generation", "common.config", "grader.pool")


def no_heavy_modules(completion: str, reference: str) -> float:
    """1 when the worker process that runs this has loaded none of HEAVY_MODULES."""
    import sys

    return 0.0 if any(m in sys.modules for m in HEAVY_MODULES) else 1.0


_calls = 0


def slow_first_call(completion: str, reference: str) -> float:
    """Like a grader whose first call imports a large library: 3 s once, then instant."""
    global _calls
    _calls += 1
    if _calls == 1:
        time.sleep(3)
    return float(completion == reference)


def coin_or_never(completion: str, reference: str) -> float:
    """``coin``: right or wrong by the completion's length, so a group of random completions is nearly always mixed;
    ``never``: always wrong. What difficulty sampling tells apart."""
    if reference == "coin":
        return float(len(completion) % 2)
    return 0.0


# Misbehaving tools, importable as ``tests.graders_for_tests:<name>`` by tool worker processes (env.tools).
def tool_hangs_on_x(call: str) -> str:
    if "x" in call:
        time.sleep(3600)
    return call.upper()


def tool_dies_on_x(call: str) -> str:
    if "x" in call:
        os._exit(3)
    return call.upper()


def tool_hogs_on_x(call: str) -> str:
    if "x" in call:
        return str(len(bytearray(2 * 1024**3)))  # 2 GiB: past a tool's memory limit
    return call.upper()


def tool_echo(call: str) -> str:
    """Any call works: its text backwards (tests of episodes whose calls a random model writes)."""
    return call[::-1]


def calculator_hangs_on_77_dies_on_99(call: str) -> str:
    """The calculator, except that a call naming 77 never returns and one naming 99 kills its worker."""
    if "77" in call:
        time.sleep(3600)
    if "99" in call:
        os._exit(3)
    from env.calculator import calculator

    return calculator(call)


def hog_on_x(completion: str, reference: str) -> float:
    """A grader that asks for 2 GiB on "x": past a worker's memory limit."""
    if completion == "x":
        return float(len(bytearray(2 * 1024**3)))
    return float(completion == reference)
