"""The algorithm's shared math, under the import path the project's design names (``common.grpo.group_advantages``):
from rewards to advantages, the zero-std test and DAPO's overlong penalty (common.grpo.advantages), and the
log-prob of a sampled token as engines report it and the learner scores it (common.grpo.logprobs)."""

from common.grpo.advantages import group_advantages, group_std, is_zero_std, overlong_penalty
from common.grpo.logprobs import token_logprobs

__all__ = ["group_advantages", "group_std", "is_zero_std", "overlong_penalty", "token_logprobs"]
