"""The grader a role grades with, as ``grader`` configures it: a grader function in a worker pool
(:class:`grader.pool.GraderPool`) or a scoring service's client (:class:`grader.service.ServiceGrader`), both
:class:`common.rollout.SampleGrader` s."""

from __future__ import annotations

from common import grader_names
from common.config import ConfigError, GraderConfig
from common.rollout import SampleGrader
from grader.pool import GraderPool
from grader.service import ServiceGrader


def open_grader(cfg: GraderConfig) -> SampleGrader:
    """An unknown or unimportable grader is a user's config mistake."""
    if cfg.name == grader_names.SERVICE:
        return ServiceGrader(
            cfg.url, timeout_s=cfg.timeout_s, batch_size=cfg.batch_size, retries=cfg.retries,
            retry_backoff_s=cfg.retry_backoff_s, round_budget_s=cfg.round_budget_s,
        )  # fmt: skip
    try:
        return GraderPool(cfg.spec(), cfg.timeout_s, cfg.isolation, cfg.memory_mb)
    except KeyError as e:
        raise ConfigError(f"config error: grader.name: {e.args[0]}") from None
