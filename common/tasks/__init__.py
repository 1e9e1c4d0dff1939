"""What the policy is trained and judged on: what a task is (common.tasks.task: a problem, the training prompts and
the held-out ones), the prompt sources (common.tasks.problems; reasoning-gym's in common.tasks.gym), whose names this
face hands on, and the held-out evaluation both roles and ``grpo eval`` share (common.tasks.evaluation, imported
from there)."""

from __future__ import annotations

from common.tasks.problems import (
    FILE_SUFFIXES,
    Problem,
    PromptEncoder,
    Task,
    addition_problems,
    addition_task,
    arithmetic_task,
    eval_problems,
    is_file_source,
    load_rows,
    make_problems,
    make_task,
)

__all__ = [
    "FILE_SUFFIXES",
    "Problem",
    "PromptEncoder",
    "Task",
    "addition_problems",
    "addition_task",
    "arithmetic_task",
    "eval_problems",
    "is_file_source",
    "load_rows",
    "make_problems",
    "make_task",
]
