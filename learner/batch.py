"""Pure assembly of training tensors from group messages, and the step's reward statistics.

Layout: row i is ``prompt + completion`` right-padded to the longest row, so position ids are 0..L−1 for real tokens
as in generation. Everything per token lives in the shifted space (B, L−1): entry t is the log-prob of token t+1
given tokens ≤ t, and ``loss_mask`` marks the completion tokens the model wrote (the prompt is never trained on).

Multi-turn episodes (common.schemas.masks): the tokens an environment wrote into a completion (a tool's output) are
in ``input_ids``, since the model conditions on them, but not in ``loss_mask``, and their behaviour log-prob (NaN on
the wire) is 0 here, chosen with ``where``, never multiplied by the mask (NaN × 0 is NaN). Every per-token figure
reads ``loss_mask``, so the token counts of the loss (dapo's divisor, grpo's per-answer means), the clip, KL,
mismatch and staleness figures and the completion lengths count the model's tokens alone.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from itertools import pairwise

import numpy as np
import torch

from common.grpo.advantages import group_std, is_zero_std
from common.schemas import Completions, FilteredStats, GroupMessage


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # (B, L) long
    attention_mask: torch.Tensor  # (B, L) long
    loss_mask: torch.Tensor  # (B, L-1) float: 1 where the target is a completion token the model wrote
    behavior_logprobs: torch.Tensor  # (B, L-1) float32, 0 outside the mask (the environment's tokens included)
    rewards: torch.Tensor  # (B,) float32, group-contiguous
    group_size: int
    staleness: torch.Tensor  # (G,) long: learner version − policy version, per group
    # (B, L-1) long, 0 outside the mask: each completion token's own age, its group's plus how far its version is
    # behind the group's newest (in-flight updates: common.schemas.versions); the group's where it carries no runs.
    token_staleness: torch.Tensor
    versions_per_answer: torch.Tensor  # (B,) long: how many versions produced each completion's tokens
    truncated: torch.Tensor  # (B,) bool: finish reason "length"
    # (B,) float32: each completion's overlong penalty as its actor computed it (0 for a group that carries none);
    # None when no group of the batch carries any (no shaping).
    penalties: torch.Tensor | None = None

    @property
    def completion_lengths(self) -> torch.Tensor:
        """(B,) each completion's tokens the model wrote (an environment's are input, not answer)."""
        return self.loss_mask.sum(dim=1)

    @property
    def row_lengths(self) -> torch.Tensor:
        """(B,) each row's real tokens, prompt and completion (the rest of the row is right padding)."""
        return self.attention_mask.sum(dim=1)

    def to(self, device: torch.device | str) -> Batch:
        tensors = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "group_size"}
        return replace(self, **{k: v.to(device) for k, v in tensors.items() if v is not None})


def assemble(groups: list[GroupMessage], pad_id: int, learner_version: int) -> Batch:
    if not groups:
        raise ValueError("an empty batch")
    group_size = len(groups[0].completions)
    if any(len(g.completions) != group_size for g in groups):
        raise ValueError("every group of a batch must have the same size")
    # Each group's completions arrive as columns (all token ids end to end, all log-probs end to end): a row is a
    # slice of them, copied once into the padded tensors.
    cols = [g.columns for g in groups]
    width = max(len(g.prompt_ids) + int(c.lengths.max()) for g, c in zip(groups, cols, strict=True))
    b = len(groups) * group_size
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width - 1), dtype=torch.float32)
    behavior = torch.zeros((b, width - 1), dtype=torch.float32)
    ages = torch.zeros((b, width - 1), dtype=torch.long)
    row = 0
    for g, c in zip(groups, cols, strict=True):
        prompt = torch.from_numpy(g.prompt_ids.astype(np.int64))
        tokens = torch.from_numpy(c.token_ids.astype(np.int64))
        model = np.ones(len(c.token_ids), np.bool_) if c.mask is None else c.mask > 0
        # 0 where the environment wrote the token (its NaN never reaches a tensor), and a writable copy either way.
        logprobs = torch.from_numpy(np.where(model, c.logprobs, np.float32(0.0)).astype(np.float32, copy=False))
        written = torch.from_numpy(model.astype(np.float32))
        age = torch.where(written > 0, _token_ages(c, learner_version - g.policy_version), 0)
        p, offsets = len(prompt), c.offsets.tolist()
        for a, e in pairwise(offsets):
            n = e - a
            input_ids[row, :p] = prompt
            input_ids[row, p : p + n] = tokens[a:e]
            attention[row, : p + n] = 1
            # Token p+j is predicted at shifted position p+j−1.
            mask[row, p - 1 : p - 1 + n] = written[a:e]
            behavior[row, p - 1 : p - 1 + n] = logprobs[a:e]
            ages[row, p - 1 : p - 1 + n] = age[a:e]
            row += 1
    runs = np.concatenate([c.runs.counts if c.runs is not None else np.ones(len(c), np.int32) for c in cols])
    return Batch(
        input_ids=input_ids, attention_mask=attention, loss_mask=mask, behavior_logprobs=behavior,
        rewards=torch.from_numpy(np.concatenate([c.rewards for c in cols]).astype(np.float32)), group_size=group_size,
        staleness=torch.tensor([learner_version - g.policy_version for g in groups], dtype=torch.long),
        token_staleness=ages, versions_per_answer=torch.from_numpy(runs).long(),
        truncated=torch.tensor([r == "length" for c in cols for r in c.finish_reasons], dtype=torch.bool),
        penalties=_penalties(groups, group_size),
    )  # fmt: skip


def _token_ages(c: Completions, group_age: int) -> torch.Tensor:
    """(N,) every completion token's age in versions: the group's, plus how far behind its newest version the
    token's is (0 for every token of a group without runs)."""
    if c.runs is None:
        return torch.full((len(c.token_ids),), group_age, dtype=torch.long)
    return torch.from_numpy(group_age + (c.runs.newest() - c.runs.token_versions()))


def _penalties(groups: list[GroupMessage], group_size: int) -> torch.Tensor | None:
    if all(g.penalties is None for g in groups):
        return None
    zeros = np.zeros(group_size, np.float32)
    return torch.from_numpy(np.concatenate([zeros if g.penalties is None else g.penalties for g in groups]))


def env_share(groups: list[GroupMessage]) -> dict[str, float]:
    """``tokens/env_frac``: the share of the batch's completion tokens an environment wrote (tool output in
    multi-turn episodes; 0 when none), which the model reads but is not trained on."""
    total = sum(len(g.columns.token_ids) for g in groups)
    env = sum(int(np.count_nonzero(m == 0)) for g in groups if (m := g.columns.mask) is not None)
    return {"tokens/env_frac": env / max(total, 1)}


AGE_BUCKETS = 3  # tokens/age_0 … age_2 one key each, older ones together (max_staleness is 2 by default)


def version_spread(batch: Batch) -> dict[str, float]:
    """How old the completion tokens are and how many versions each answer spans (in-flight updates spread an
    answer over several): ``staleness/token_mean``, ``staleness/token_max``, ``versions/per_answer`` (mean) and
    ``versions/mixed_frac`` (the share of answers with tokens of more than one version), and the tokens per version
    as shares by age: ``tokens/age_0`` (the learner's own version) … ``tokens/age_2``, ``tokens/age_3plus``."""
    on = batch.loss_mask > 0
    ages = batch.token_staleness[on].float()
    per_answer = batch.versions_per_answer.float()
    by_age = torch.bincount(ages.long().clamp(0, AGE_BUCKETS), minlength=AGE_BUCKETS + 1) / max(ages.numel(), 1)
    return {
        "staleness/token_mean": float(ages.mean()) if ages.numel() else 0.0,
        "staleness/token_max": float(ages.max()) if ages.numel() else 0.0,
        "versions/per_answer": float(per_answer.mean()),
        "versions/mixed_frac": float((per_answer > 1).float().mean()),
        **{f"tokens/age_{a}": float(by_age[a]) for a in range(AGE_BUCKETS)},
        f"tokens/age_{AGE_BUCKETS}plus": float(by_age[AGE_BUCKETS]),
    }


def micro_batches(rows: torch.Tensor, lengths: torch.Tensor, budget: int, world: int = 1) -> list[torch.Tensor]:
    """``rows`` (indices into the batch) grouped into micro-batches of at most ``budget`` padded tokens per rank's
    forward (``learner.micro_batch_tokens``): longest rows first, so that rows of like length share a forward and
    little of it is padding; a micro-batch takes rows while ⌈rows / world⌉ × its longest row fits, and a row longer
    than the budget goes alone. Under torchrun every rank computes the same list (it is pure and deterministic), and
    so takes the same number of micro-batches; each holds at least ``world`` rows, so that every rank has some of
    each (a budget too small for that is exceeded, and a short last one joins the one before it)."""
    order = rows[torch.argsort(lengths[rows], descending=True, stable=True)]
    widths = lengths[order].tolist()
    bounds = [0]
    for i in range(1, len(widths)):
        start = bounds[-1]
        if i - start >= world and -(-(i + 1 - start) // world) * widths[start] > budget:
            bounds.append(i)
    if len(bounds) > 1 and len(widths) - bounds[-1] < world:
        bounds.pop()
    return [order[a:b] for a, b in zip(bounds, [*bounds[1:], len(widths)], strict=True)]


def sampled_reward_stats(groups: list[GroupMessage], filtered: FilteredStats) -> dict[str, float]:
    """``reward``, ``reward_std``, ``frac_reward_zero_std`` over everything the actors sampled for these groups —
    the groups themselves plus the ones actors filtered out meanwhile (``filtered``, read from Redis by the
    intake) — and ``reward/trained`` over the groups alone. ``reward_std`` is the mean over groups of each group's
    std, before any filtering as in TRL; here the population std (ddof 0, the seed's convention), where TRL's is
    Bessel-corrected."""
    rewards = [g.rewards for g in groups]
    n_groups = len(groups) + filtered.groups
    n_completions = sum(len(r) for r in rewards) + filtered.completions
    reward_sum = sum(sum(r) for r in rewards) + filtered.reward_sum
    std_sum = sum(group_std(r) for r in rewards) + filtered.reward_std_sum
    zero_std = sum(is_zero_std(r) for r in rewards) + filtered.zero_std_groups
    return {
        "reward": reward_sum / n_completions,
        "reward_std": std_sum / n_groups,
        "frac_reward_zero_std": zero_std / n_groups,
        "reward/trained": sum(sum(r) for r in rewards) / sum(len(r) for r in rewards),
        "groups_sampled": float(n_groups),
    }
