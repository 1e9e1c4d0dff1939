"""Misbehaving graders, importable as ``tests.graders_for_tests:<name>`` by grader worker processes."""

from __future__ import annotations

import os
import time


def hang_on_x(completion: str, reference: str) -> float:
    if completion == "x":
        time.sleep(3600)
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
