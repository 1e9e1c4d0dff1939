"""The import path the project's design names for its Python API (``common.grpo.group_advantages``), kept so that
code written against it still runs. The pieces live in :mod:`common.advantages` and :mod:`common.logprobs`."""

from common.advantages import group_advantages, group_std, is_zero_std, overlong_penalty
from common.logprobs import token_logprobs

__all__ = ["group_advantages", "group_std", "is_zero_std", "overlong_penalty", "token_logprobs"]
