"""``grpo actor``: one actor process (sample, grade, filter, send), for docker compose, clusters and ``grpo run``."""

from __future__ import annotations

from collections.abc import Sequence

from common.cli import parse_config
from common.config import check_device, check_engine
from common.log import setup_logging


def main(argv: Sequence[str]) -> int:
    cfg = parse_config("grpo actor", __doc__ or "", argv)
    setup_logging("actor", cfg.run.log_level)
    if cfg.actor.engine == "local":  # sglang: the server's device is sglang.device; sim loads no model
        check_device(cfg.model.device)
    check_engine(cfg.actor.engine, cfg.sglang.url, cfg.sglang.device, cfg.learner.lora.rank)
    from actor.process import run_actor  # torch and transformers load only after the arguments are valid

    return run_actor(cfg)
