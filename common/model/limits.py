"""What the model bounds beyond itself: the largest group message a run can produce, which the actors (to refuse
an oversized round before it is written) and the learner (to read within a byte budget) derive alike."""

from __future__ import annotations

from common.config import Config
from common.model.loading import max_positions


def message_byte_limit(cfg: Config) -> int:
    """``redis.max_message_bytes``, or (0) twice the largest valid group of this run on the wire, plus 64 KiB: a
    prompt as long as the model's positions (or ``task.max_prompt_tokens``; 32,768 tokens when neither says) and
    ``group_size`` completions of ``sampling.max_new_tokens``, at 12 bytes a token (a 4-byte id and an 8-byte
    log-prob, the widest the schema takes) and 64 bytes a completion. Actors and the learner derive the same."""
    if cfg.redis.max_message_bytes:
        return cfg.redis.max_message_bytes
    prompt = cfg.task.max_prompt_tokens or _positions(cfg.model.path) or 32_768
    g = cfg.sampling.group_size
    return 2 * (12 * (prompt + g * cfg.sampling.max_new_tokens) + 64 * g) + 64 * 1024


def _positions(path: str) -> int | None:
    try:
        return max_positions(path)
    except Exception:  # not a model directory this process can read (an SGLang actor's server-side path)
        return None
