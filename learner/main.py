"""``grpo learner``: the learner process (consume groups, train, publish weights), for compose and ``grpo run``."""

from __future__ import annotations

from collections.abc import Sequence

from common.cli import parse_config
from common.config import check_device
from common.log import setup_logging


def main(argv: Sequence[str]) -> int:
    cfg = parse_config("grpo learner", __doc__ or "", argv)
    setup_logging("learner", cfg.run.log_level)
    check_device(cfg.model.device)
    from learner.process import run_learner  # torch and transformers load only after the arguments are valid

    return run_learner(cfg)
