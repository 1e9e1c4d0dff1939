"""What the model bounds beyond itself: the largest group message a run can produce, which the actors (to refuse
an oversized round before it is written) and the learner (to read within a byte budget) derive alike."""

from __future__ import annotations

from common.config import Config
from common.model.loading import max_positions


def message_byte_limit(cfg: Config) -> int:
    """``redis.max_message_bytes``, or (0) twice the largest valid group of this run on the wire, plus 64 KiB: a
    prompt as long as the model's positions (or ``task.max_prompt_tokens``; 32,768 tokens when neither says) and
    ``group_size`` completions of ``sampling.max_new_tokens`` (an episode's most tokens with a tool environment,
    ``env.max_episode_tokens``), at 12 bytes a token (a 4-byte id and an 8-byte
    log-prob, the widest the schema takes; an episode's mask of environment tokens, a byte a token at most, fits in
    the margin) and 64 bytes a completion. Actors and the learner derive the same."""
    if cfg.redis.max_message_bytes:
        return cfg.redis.max_message_bytes
    prompt = cfg.task.max_prompt_tokens or _positions(cfg.model.path) or 32_768
    g = cfg.sampling.group_size
    completion = cfg.env.max_episode_tokens(cfg.sampling.max_new_tokens)
    return 2 * (12 * (prompt + g * completion) + 64 * g) + 64 * 1024


def _positions(path: str) -> int | None:
    try:
        return max_positions(path)
    except Exception:  # not a model directory this process can read (an SGLang actor's server-side path)
        return None


def prompt_token_limit(cfg: Config) -> int | None:
    """``task.max_prompt_tokens``, or the model's positions less the answer's room; None when unknown. The longest
    prompt an actor samples from, and the longest context an episode's next turn starts from (env.episodes)."""
    if cfg.task.max_prompt_tokens:
        return cfg.task.max_prompt_tokens
    positions = max_positions(cfg.model.path)
    return None if positions is None else max(1, positions - cfg.sampling.max_new_tokens)
