"""Logging: one format for every process, so interleaved logs of a run read as one story."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(role: str, level: str = "INFO") -> logging.Logger:
    """Log to stderr as ``time level role[pid] logger: message``; quiet the chatty libraries."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s {role}[{os.getpid()}] %(name)s: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("urllib3", "filelock", "transformers", "httpx", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # datasets reading a local directory: "Repo card metadata block was not found", once per split, in every process.
    logging.getLogger("huggingface_hub.repocard").setLevel(logging.ERROR)
    # transformers prints progress bars when it saves or loads weights; a training loop does that every step.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    return logging.getLogger(role)
