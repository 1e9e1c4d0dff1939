"""The one config tree of the pipeline (pydantic v2).

Every process (``grpo run``, ``grpo learner``, ``grpo actor``) loads the same tree, in this order, later wins:

1. the defaults below (they are the CPU demo: single-digit addition on a tiny model);
2. YAML files (``--config FILE``, repeatable: a base recipe, then a local override; mappings merge, later wins,
   a list is replaced whole);
3. the environment, for secrets and deployment settings: ``GRPO_REDIS_URL``, ``GRPO_REDIS_USERNAME``,
   ``GRPO_REDIS_PASSWORD``, ``GRPO_RUN_NAME``, ``GRPO_RUN_DIR``, ``GRPO_MODEL_PATH``, ``GRPO_TASK_PATH``;
4. ``-o key=value`` dotted overrides from the command line (values are parsed as YAML: ``-o learner.lr=1e-3``).

YAML is read with YAML 1.2's booleans (only ``true`` and ``false``): PyYAML's YAML 1.1 reads ``on``, ``off``, ``yes``
and ``no`` as booleans, which would turn the documented ``chat_template: off`` into ``False``. Boolean keys still
take those words, as pydantic reads them.

Invalid values raise :class:`ConfigError` whose message is one line per problem, naming the field; the CLI prints it
and exits with code 2. The resolved tree is written to ``<run.dir>/config.json``.

This package's face is the config's one import path; the code lives in it, by what it holds:
:mod:`common.config.shared` (the sections every role reads), :mod:`common.config.actor` (the actor's ``actor`` and
``sglang``), :mod:`common.config.learner` (the learner's ``learner`` and ``checkpoint``),
:mod:`common.config.tree` (the tree and its cross-section checks), :mod:`common.config.yaml12` (the YAML 1.2 reader),
:mod:`common.config.loading` (files, environment, overrides, errors), :mod:`common.config.checks` (the model path and
device on this machine) and :mod:`common.config.reference` (docs/configuration.md and ``grpo config --keys``).
"""

from __future__ import annotations

from common.config.actor import SGLANG_CPU_ARGS, ActorConfig, SGLangConfig
from common.config.checks import check_device, check_engine, check_model_path
from common.config.grading import EnvConfig, GraderComponent, GraderConfig, ShapingConfig
from common.config.learner import AdvantageConfig, CheckpointConfig, LearnerConfig, LoraConfig
from common.config.loading import (
    ENV_KEYS,
    MOVED,
    ConfigError,
    ConfigPaths,
    load_config,
    parse_override,
    write_resolved,
)
from common.config.reference import key_rows, reference_markdown
from common.config.shared import (
    GymDataset,
    MetricsConfig,
    ModelConfig,
    RedisConfig,
    RunConfig,
    SamplingConfig,
    TaskConfig,
    WeightsConfig,
    template_fields,
)
from common.config.tree import Config, mask_url
from common.config.yaml12 import YamlLoader, read_yaml

__all__ = [
    "ENV_KEYS",
    "MOVED",
    "SGLANG_CPU_ARGS",
    "ActorConfig",
    "AdvantageConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "ConfigPaths",
    "EnvConfig",
    "GraderComponent",
    "GraderConfig",
    "GymDataset",
    "LearnerConfig",
    "LoraConfig",
    "MetricsConfig",
    "ModelConfig",
    "RedisConfig",
    "RunConfig",
    "SGLangConfig",
    "SamplingConfig",
    "ShapingConfig",
    "TaskConfig",
    "WeightsConfig",
    "YamlLoader",
    "check_device",
    "check_engine",
    "check_model_path",
    "key_rows",
    "load_config",
    "mask_url",
    "parse_override",
    "read_yaml",
    "reference_markdown",
    "template_fields",
    "write_resolved",
]
