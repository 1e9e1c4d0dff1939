"""The config tree: one section per key of the YAML, and the checks that span sections."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import model_validator

from common.config.actor import ActorConfig, SGLangConfig
from common.config.grading import EnvConfig, GraderConfig, ShapingConfig
from common.config.learner import CheckpointConfig, LearnerConfig
from common.config.shared import (
    MetricsConfig,
    ModelConfig,
    RedisConfig,
    RunConfig,
    SamplingConfig,
    Section,
    TaskConfig,
    WeightsConfig,
)


class Config(Section):
    run: RunConfig = RunConfig()
    redis: RedisConfig = RedisConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sampling: SamplingConfig = SamplingConfig()
    shaping: ShapingConfig = ShapingConfig()
    grader: GraderConfig = GraderConfig()
    env: EnvConfig = EnvConfig()
    actor: ActorConfig = ActorConfig()
    learner: LearnerConfig = LearnerConfig()
    weights: WeightsConfig = WeightsConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    sglang: SGLangConfig = SGLangConfig()
    metrics: MetricsConfig = MetricsConfig()

    @model_validator(mode="after")
    def _fill_derived_defaults(self) -> Config:
        """The keys whose empty default is worked out from others: the run's directories and the stream bound."""
        if not self.run.dir:
            self.run.dir = str(Path("runs") / self.run.name)
        if not self.weights.dir:
            self.weights.dir = str(Path(self.run.dir) / "weights")
        if not self.checkpoint.dir:
            self.checkpoint.dir = str(Path(self.run.dir) / "checkpoints")
        if not self.actor.max_stream_groups:
            # Two batches waiting to be read: the learner never starves, and staleness stays near 1 version.
            self.actor.max_stream_groups = 2 * self.learner.batch_groups
        return self

    @model_validator(mode="after")
    def _check_task_grader(self) -> Config:
        """A reasoning_gym problem's reference says where it came from, not its answer: only the reasoning_gym grader
        (alone or in a combine) reads it, and your own or a service may; it reads no other task's references."""
        g = self.grader
        names = {g.name, *(c.name for c in g.components)}
        gym = self.task.name == "reasoning_gym"
        if gym and not _grades_gym_problems(g):
            raise ValueError(
                f"grader.name: the reasoning_gym task is graded by its datasets' own scoring: grader.name="
                f"reasoning_gym, or a combine of it with format or your own graders, got {g.name}"
                + (f" of {', '.join(c.name for c in g.components)}" if g.components else "")
            )
        if gym and g.isolation == "inline" and g.name != "service":
            raise ValueError(
                "grader.isolation: the reasoning_gym task is graded in worker processes (process), which regenerate "
                "each problem with the task's string hashing; inline grading in this process could not"
            )
        if not gym and "reasoning_gym" in names:
            raise ValueError(f"grader.name: reasoning_gym grades task.name=reasoning_gym only, not {self.task.name}")
        return self

    @model_validator(mode="after")
    def _check_across_sections(self) -> Config:
        """Settings of different sections that only fail together (each alone is valid)."""
        if self.actor.synchronous and (
            self.actor.prompts_per_round < self.learner.batch_groups or self.actor.filter_zero_std
        ):
            raise ValueError(
                "actor.synchronous: each round must fill a batch (actor.prompts_per_round >= learner.batch_groups) "
                "and none of it may be filtered (actor.filter_zero_std=false), or the learner waits forever"
            )
        rows = self.learner.batch_groups * self.sampling.group_size
        if rows < self.learner.updates_per_batch * self.learner.grad_accum:
            raise ValueError(
                f"learner.updates_per_batch x learner.grad_accum ({self.learner.updates_per_batch} x "
                f"{self.learner.grad_accum}) exceeds the {rows} completions of a batch: micro-batches would be empty"
            )
        if self.shaping.overlong_cache >= self.sampling.max_new_tokens:
            raise ValueError(
                f"shaping.overlong_cache ({self.shaping.overlong_cache}) must be below sampling.max_new_tokens "
                f"({self.sampling.max_new_tokens})"
            )
        return self

    def resolved_dict(self) -> dict[str, Any]:
        """The tree as plain JSON values without secrets (this is what config.json holds).

        The password is left out and a password inside the URL is masked: pass secrets through the environment.
        """
        tree = json.loads(self.model_dump_json())
        tree["redis"]["password"] = None
        tree["redis"]["url"] = mask_url(self.redis.url)
        return tree


def mask_url(url: str) -> str:
    """``redis://user:secret@host:6379/0`` → ``redis://user:***@host:6379/0`` (also with several hosts, as a
    Sentinel URL has)."""
    parts = urlsplit(url)
    # redis-py also takes a password from the query string (?password=...)
    query = re.sub(r"(?i)(^|&)(password=)[^&]*", r"\1\2***", parts.query)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    netloc = f"{userinfo.split(':', 1)[0]}:***@{hosts}" if at and ":" in userinfo else parts.netloc
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def _grades_gym_problems(g: GraderConfig) -> bool:
    """Whether ``g`` reads a reasoning_gym problem's reference (where it came from, not its answer): the reasoning_gym
    grader, a service or your own function (they get the reference as it is); a combine only when every part that
    judges the answer does (format judges the layout alone)."""
    if g.name in ("reasoning_gym", "service") or ":" in g.name:
        return True
    judges = [c.name for c in g.components if c.name != "format"] if g.name == "combine" else []
    return bool(judges) and all(n == "reasoning_gym" or ":" in n for n in judges)
