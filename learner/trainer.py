"""One learner step's optimisation, with no I/O: ``advantages → old log-probs → mini-batch updates → statistics``.

Departures from the textbook, each a config choice (the loss itself is learner.loss):
- rewards get DAPO's soft overlong penalty before grouping (``shaping.overlong_cache``), and completions cut off at
  the length limit can be left out of the loss (``mask_truncated_completions``);
- old log-probs are by default the learner's own, computed without grad at the start of the step (``proximal``:
  AReaL's decoupled PPO — the clip then bounds the move from the *current* policy, not from whichever stale copy an
  actor used), and the behaviour policy is corrected for with importance weights (learner.loss.importance_weights);
  ``behavior`` takes the engine's log-probs as the denominator, one forward pass cheaper, with no correction;
- each batch is shuffled and split into ``updates_per_batch`` mini-batches, one AdamW step each, each made of
  ``grad_accum`` micro-batches whose gradients are accumulated; ``dapo`` divides by the whole mini-batch's token
  count, the other loss types average their micro-batch losses (as TRL does);
- the learning rate warms up linearly over ``warmup_steps`` optimizer steps, then stays or decays (learner.schedule).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from common.config import Config
from common.grpo import group_advantages, overlong_penalty
from common.schemas import GroupMessage
from learner.batch import Batch, assemble, sampled_reward_stats
from learner.loss import grpo_loss, importance_weights
from learner.schedule import lr_factor


def disable_dropout(model: torch.nn.Module) -> None:
    """RL on a model with dropout would score the same tokens differently in each forward pass: the ratio would not
    start at 1 and the importance weights would be noise. As TRL does, dropout is switched off."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


class Trainer:
    def __init__(self, cfg: Config, model: Any, pad_id: int, reference: Any = None):
        self.cfg = cfg
        self.model = model
        # The frozen starting policy of the KL penalty: it exists only when beta > 0 (no memory spent otherwise).
        self.reference = reference
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        lc = cfg.learner
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lc.lr, betas=lc.betas, weight_decay=lc.weight_decay)
        total = cfg.run.steps * lc.updates_per_batch
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup=lc.warmup_steps, total=total, schedule=lc.lr_schedule)
        )
        self._generator = torch.Generator().manual_seed(cfg.run.seed)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self, groups: list[GroupMessage], version: int) -> dict[str, float]:
        """Train on one batch of groups; returns the step's statistics (metrics.jsonl keys)."""
        batch = assemble(groups, self.pad_id, version).to(self.device)
        mask = batch.loss_mask
        if self.cfg.learner.mask_truncated_completions:
            # DAPO's overlong filtering: a cut-off answer is neither right nor wrong, so it teaches nothing.
            mask = mask * (~batch.truncated).to(mask.dtype).unsqueeze(1)
        adv, shaping = self.advantages(batch)
        old, is_weights, seen = self.old_logprobs(batch, mask)
        ref = self._scored(self.reference, batch, mask)[0] if self.reference is not None else None
        stats, first = self.update(batch, mask, adv, old, is_weights, ref)
        stats |= seen or first  # behaviour mode: what the policy looked like, from the first mini-batch
        stats |= sampled_reward_stats(groups) | shaping
        stats |= {
            "completions/mean_length": float(batch.completion_lengths.mean()),
            "completions/truncated_frac": float(batch.truncated.float().mean()),
            "staleness/mean": float(batch.staleness.float().mean()),
            "staleness/max": float(batch.staleness.max()),
            "groups_forwarded_zero_std": float(sum(g.zero_std for g in groups)),
            "tokens": float(mask.sum()),
        }
        return stats

    def advantages(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Group advantages of the (shaped) rewards."""
        rewards, shaping = batch.rewards, {}
        if self.cfg.shaping.enabled():
            s = self.cfg.shaping
            penalty = overlong_penalty(
                batch.completion_lengths.long().tolist(),
                self.cfg.sampling.max_new_tokens,
                s.overlong_cache,
                s.overlong_factor,
            )
            rewards = rewards + torch.tensor(penalty, dtype=rewards.dtype, device=rewards.device)
            shaping = {"reward/overlong_penalty": sum(penalty) / len(penalty)}
        if self.cfg.run.shuffle_rewards:  # the control experiment: rewards no longer belong to their completions
            rewards = rewards[torch.randperm(len(rewards), generator=self._generator).to(rewards.device)]
        a = self.cfg.learner.advantage
        return group_advantages(rewards, batch.group_size, scale=a.scale, ddof=a.ddof, eps=a.eps).float(), shaping

    def old_logprobs(
        self, batch: Batch, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """The ratio's denominator, the importance weights, and (proximal mode) what the current policy shows."""
        lc = self.cfg.learner
        if lc.old_logprobs == "behavior":
            return batch.behaviour_logprobs, None, {}
        prox, seen = self._scored(self.model, batch, mask)
        weights, w_stats = importance_weights(prox, batch.behaviour_logprobs, mask, cap=lc.tis_cap, mode=lc.is_mode)
        return prox, weights, seen | w_stats

    def update(
        self,
        batch: Batch,
        mask: torch.Tensor,
        adv: torch.Tensor,
        old: torch.Tensor,
        is_weights: torch.Tensor | None,
        ref: torch.Tensor | None,
    ) -> tuple[dict[str, float], dict[str, float]]:
        """``updates_per_batch`` AdamW steps over shuffled mini-batches of ``grad_accum`` micro-batches each.
        Returns the metrics (token-weighted means) and what the first micro-batch saw before any update."""
        lc, temp = self.cfg.learner, self.cfg.sampling.temperature
        weighted: dict[str, float] = defaultdict(float)
        per_update: dict[str, float] = defaultdict(float)
        first: dict[str, float] = {}
        tokens_seen = 0.0
        used_lr = self.lr
        order = torch.randperm(len(batch.rewards), generator=self._generator).to(self.device)
        minis = [rows for rows in order.chunk(lc.updates_per_batch) if len(rows)]
        self.model.train()
        for rows in minis:
            micros = [m for m in rows.chunk(lc.grad_accum) if len(m)]
            step_tokens = mask[rows].sum()
            self.optimizer.zero_grad(set_to_none=True)
            for micro in micros:
                logits = self.model(input_ids=batch.input_ids[micro], attention_mask=batch.attention_mask[micro]).logits
                logp_all = torch.log_softmax(logits[:, :-1].float() / temp, dim=-1)
                logprobs = logp_all.gather(-1, batch.input_ids[micro, 1:].unsqueeze(-1)).squeeze(-1)
                if not first:
                    first = observed(logp_all.detach(), logprobs.detach(), batch, mask, micro)
                loss, m = grpo_loss(
                    logprobs,
                    old[micro],
                    adv[micro],
                    mask[micro],
                    loss_type=lc.loss_type,
                    epsilon_low=lc.epsilon_low,
                    epsilon_high=lc.epsilon_high,
                    beta=lc.beta,
                    ref_logprobs=None if ref is None else ref[micro],
                    max_completion_length=self.cfg.sampling.max_new_tokens,
                    is_weights=None if is_weights is None else is_weights[micro],
                    # dapo: the optimizer step's token count, so accumulation gives one big mini-batch's gradient
                    num_tokens=step_tokens,
                )
                if lc.loss_type != "dapo":
                    loss = loss / len(micros)  # the other types average their micro-batch losses
                loss.backward()
                n = float(mask[micro].sum())
                for k, v in m.items():
                    weighted[k] += v * n
                tokens_seen += n
                per_update["loss"] += loss.item()
            per_update["grad_norm"] += torch.nn.utils.clip_grad_norm_(self.model.parameters(), lc.grad_clip).item()
            used_lr = self.lr
            self.optimizer.step()
            self.scheduler.step()
        self.model.eval()
        stats = {k: v / max(tokens_seen, 1.0) for k, v in weighted.items()}
        stats |= {k: v / len(minis) for k, v in per_update.items()}
        stats["lr"] = used_lr  # the rate the step's last update used
        return stats, first

    @torch.no_grad()
    def _scored(self, model: Any, batch: Batch, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Log-probs of the batch's tokens under ``model`` in eval mode (no grad; 0 outside the mask), and what they
        show (see :func:`observed`)."""
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        logp_all = torch.log_softmax(logits.float() / self.cfg.sampling.temperature, dim=-1)
        logprobs = logp_all.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) * mask
        rows = torch.arange(len(batch.rewards), device=logits.device)
        return logprobs, observed(logp_all, logprobs, batch, mask, rows)


def observed(
    logp_all: torch.Tensor, logprobs: torch.Tensor, batch: Batch, mask: torch.Tensor, rows: torch.Tensor
) -> dict[str, float]:
    """Over the completion tokens of ``rows``: the policy's mean entropy, and the mean |learner − engine| log-prob
    where both are the same policy version (groups with staleness 0), which measures the engine's numerical mismatch
    alone; it is absent when no such group is in ``rows``."""
    m = mask[rows]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    out = {"entropy": float((entropy * m).sum() / m.sum().clamp(min=1))}
    fresh = m * (batch.row_staleness[rows] == 0).to(m.dtype).unsqueeze(1)
    if fresh.sum() > 0:
        diff = (logprobs - batch.behaviour_logprobs[rows]).abs() * fresh
        out["mismatch/logprob_abs_mean"] = float(diff.sum() / fresh.sum())
    return out
