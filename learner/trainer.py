"""One learner step's optimisation, with no I/O: ``advantages → old log-probs → mini-batch updates → statistics``.

Departures from the textbook, each a config choice (the loss itself is learner.loss):
- rewards get DAPO's soft overlong penalty before grouping (``shaping.overlong_cache``), and completions cut off at
  the length limit can be left out of the loss (``mask_truncated_completions``);
- old log-probs are by default the learner's own, computed without grad at the start of the step (``proximal``:
  AReaL's decoupled PPO — the clip then bounds the move from the *current* policy, not from whichever stale copy an
  actor used), and the behaviour policy is corrected for with importance weights (learner.loss.importance_weights);
  ``behavior`` takes the engine's log-probs as the denominator, one forward pass cheaper, with no correction. With
  one update per batch (``updates_per_batch`` 1) the proximal policy *is* the policy being trained, before its only
  update: its log-probs are taken from the training forward itself (detached), and the scoring pass is skipped;
- each batch is shuffled and split into ``updates_per_batch`` mini-batches, one AdamW step each, each made of
  ``grad_accum`` micro-batches whose gradients are accumulated; ``dapo`` divides by the whole mini-batch's token
  count and ``grpo``/``dr_grpo`` weight each micro-batch by its share of rows, so accumulation does not change
  their gradient (``bnpo``'s token mean is per micro-batch by definition); an update whose gradient norm is not finite
  (a NaN or infinity anywhere in the loss or its gradient) is not applied and is counted
  (``updates_skipped_nonfinite``); the step's ``loss`` and ``grad_norm`` are the means over the updates applied (NaN
  when none was: the learner then drops the step's groups as ``nonfinite``, see learner.loop);
- the learning rate warms up linearly over ``warmup_steps`` optimizer steps, then stays or decays (learner.schedule).
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from common.advantages import group_advantages, overlong_penalty
from common.config import Config
from common.schemas import GroupMessage
from learner.batch import Batch, assemble, sampled_reward_stats
from learner.distributed import Ranks
from learner.loss import grpo_loss, importance_weights
from learner.schedule import lr_factor


def disable_dropout(model: torch.nn.Module) -> None:
    """RL on a model with dropout would score the same tokens differently in each forward pass: the ratio would not
    start at 1 and the importance weights would be noise. As TRL does, dropout is switched off."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


class Trainer:
    def __init__(self, cfg: Config, model: Any, pad_id: int, reference: Any = None, ranks: Ranks | None = None):
        self.cfg = cfg
        self.model = model
        # Under torchrun (learner.distributed): every rank holds the whole batch and trains on its slice of each
        # micro-batch; the model is FSDP2-sharded by then.
        self.ranks = ranks
        self.rank, self.world = (ranks.rank, ranks.world) if ranks is not None else (0, 1)
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
        self.generator = torch.Generator().manual_seed(cfg.run.seed)
        # Proximal log-probs from the training forward when a batch gets one update (see the module docstring);
        # False forces the separate scoring pass (the tests compare the two).
        self.fuse_proximal = lc.old_logprobs == "proximal" and lc.updates_per_batch == 1

    def autocast(self) -> Any:
        """Forward passes in bfloat16 under ``learner.autocast`` while parameters and AdamW's state keep
        ``model.dtype``: with float32 parameters, updates far smaller than the weights (lr 1e-6) are not rounded
        away as they are in bfloat16 parameters. Log-softmax and the loss are computed in float32 either way."""
        if self.cfg.learner.autocast == "off":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

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
        old, is_weights, seen = (None, None, {}) if self.fuse_proximal else self.old_logprobs(batch, mask)
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
            rewards = rewards[torch.randperm(len(rewards), generator=self.generator).to(rewards.device)]
        a = self.cfg.learner.advantage
        return group_advantages(rewards, batch.group_size, scale=a.scale, ddof=a.ddof, eps=a.eps).float(), shaping

    def old_logprobs(
        self, batch: Batch, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """The ratio's denominator, the importance weights, and (proximal mode) what the current policy shows."""
        lc = self.cfg.learner
        if lc.old_logprobs == "behavior":
            return batch.behaviour_logprobs, None, {}
        prox, seen = self._scored(self.model, batch, mask, Seen())
        weights, w_stats = importance_weights(prox, batch.behaviour_logprobs, mask, cap=lc.tis_cap, mode=lc.is_mode)
        return prox, weights, seen | w_stats

    def update(
        self,
        batch: Batch,
        mask: torch.Tensor,
        adv: torch.Tensor,
        old: torch.Tensor | None,
        is_weights: torch.Tensor | None,
        ref: torch.Tensor | None,
    ) -> tuple[dict[str, float], dict[str, float]]:
        """``updates_per_batch`` AdamW steps over shuffled mini-batches of ``grad_accum`` micro-batches each (sizes
        as even as possible). Returns the metrics (token-weighted means) and, in behaviour mode, what the first
        micro-batch saw before any update (proximal mode measured it in its scoring pass already). ``old`` None:
        the proximal log-probs are each micro-batch's own, before the batch's single update (:class:`Fused`)."""
        lc, temp = self.cfg.learner, self.cfg.sampling.temperature
        weighted: dict[str, float] = defaultdict(float)
        per_update: dict[str, float] = defaultdict(float)
        fused = Fused(mask) if old is None else None
        first = Seen() if lc.old_logprobs == "behavior" else None
        first_taken = False
        tokens_seen = 0.0
        applied = 0
        used_lr = self.lr
        order = torch.randperm(len(batch.rewards), generator=self.generator).to(self.device)
        self.model.train()
        for rows in order.tensor_split(lc.updates_per_batch):
            step_tokens = mask[rows].sum()
            update_loss = 0.0
            self.optimizer.zero_grad(set_to_none=True)
            for micro in rows.tensor_split(lc.grad_accum):
                mine = self._mine(micro)
                with self.autocast():
                    out = self.model(input_ids=batch.input_ids[mine], attention_mask=batch.attention_mask[mine])
                logits = out.logits
                logp_all = torch.log_softmax(logits[:, :-1].float() / temp, dim=-1)
                logprobs = logp_all.gather(-1, batch.input_ids[mine, 1:].unsqueeze(-1)).squeeze(-1)
                if first is not None and not first_taken and float(mask[micro].sum()) > 0:
                    # The first micro-batch with tokens, judged on the whole micro-batch so that every rank takes
                    # its slice of the same one.
                    first.add(logp_all.detach(), logprobs.detach(), batch, mask, mine)
                    first_taken = True
                w_mine: torch.Tensor | None
                if fused is not None:
                    old_mine, w_mine = fused.add(logp_all.detach(), logprobs.detach(), batch, mine, lc)
                else:
                    assert old is not None
                    old_mine, w_mine = old[mine], None if is_weights is None else is_weights[mine]
                loss, m = grpo_loss(
                    logprobs,
                    old_mine,
                    adv[mine],
                    mask[mine],
                    loss_type=lc.loss_type,
                    epsilon_low=lc.epsilon_low,
                    epsilon_high=lc.epsilon_high,
                    beta=lc.beta,
                    ref_logprobs=None if ref is None else ref[mine],
                    max_completion_length=self.cfg.sampling.max_new_tokens,
                    is_weights=w_mine,
                    # dapo: the optimizer step's token count, so accumulation gives one big mini-batch's gradient
                    num_tokens=step_tokens,
                )
                if lc.loss_type != "dapo":
                    # The other types are means over their micro-batch's rows: weighting each by its share of the
                    # mini-batch's rows makes grpo and dr_grpo equal to one big mini-batch (bnpo's token mean stays
                    # per micro-batch, as its definition says). A rank's slice is weighted by its share of the
                    # micro-batch the same way: by rows, or by tokens for bnpo.
                    if lc.loss_type == "bnpo":
                        share = float(mask[mine].sum()) / max(float(mask[micro].sum()), 1.0)
                    else:
                        share = len(mine) / len(micro)
                    loss = loss * (share * len(micro) / len(rows))
                # FSDP averages the ranks' gradients; their losses add up to the micro-batch's, so scale back.
                (loss * self.world if self.world > 1 else loss).backward()
                n = float(mask[mine].sum())
                for k, v in m.items():
                    weighted[k] += v * n
                tokens_seen += n
                update_loss += loss.item()
            grad_norm = _scalar(torch.nn.utils.clip_grad_norm_(self.model.parameters(), lc.grad_clip))
            if not torch.isfinite(grad_norm):
                # One NaN/inf would poison every weight from here on: skip the update, and say so in the metrics.
                per_update["updates_skipped_nonfinite"] += 1
                self.optimizer.zero_grad(set_to_none=True)
            else:
                # Only applied updates count in the step's loss: a skipped one's is not finite and moved nothing.
                per_update["loss"] += update_loss
                per_update["grad_norm"] += grad_norm.item()
                applied += 1
                used_lr = self.lr
                self.optimizer.step()
            self.scheduler.step()
        self.model.eval()
        if self.ranks is not None:  # the ranks' sums: token-weighted metrics, tokens, the loss's parts
            keys = sorted(weighted)
            total = self.ranks.sum([weighted[k] for k in keys] + [tokens_seen, per_update["loss"]])
            weighted = defaultdict(float, zip(keys, total[: len(keys)], strict=True))
            tokens_seen, per_update["loss"] = total[-2], total[-1]
            if first is not None:
                first.reduce(self.ranks)
        seen = fused.finish(batch, lc, self.ranks) if fused is not None else first.stats() if first is not None else {}
        stats = {k: v / max(tokens_seen, 1.0) for k, v in weighted.items()}
        # The ranks agree on which updates were applied (the gradient norm is the whole model's).
        stats |= {k: per_update[k] / applied if applied else math.nan for k in ("loss", "grad_norm")}
        stats["updates_skipped_nonfinite"] = per_update["updates_skipped_nonfinite"]
        stats["lr"] = used_lr  # the rate the step's last update used
        return stats, seen

    @torch.no_grad()
    def _scored(
        self, model: Any, batch: Batch, mask: torch.Tensor, seen: Seen | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Log-probs of the batch's tokens under ``model`` in eval mode (no grad; 0 outside the mask), scored in
        chunks the size of a training micro-batch (so ``grad_accum`` bounds this pass's memory too), and, with
        ``seen``, what the policy shows (see :class:`Seen`)."""
        lc = self.cfg.learner
        out = torch.zeros_like(mask)
        for chunk in torch.arange(len(batch.rewards), device=mask.device).tensor_split(
            lc.updates_per_batch * lc.grad_accum
        ):
            rows = self._mine(chunk)
            with self.autocast():
                logits = model(input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows]).logits[
                    :, :-1
                ]
            logp_all = torch.log_softmax(logits.float() / self.cfg.sampling.temperature, dim=-1)
            logprobs = logp_all.gather(-1, batch.input_ids[rows, 1:].unsqueeze(-1)).squeeze(-1)
            out[rows] = logprobs * mask[rows]
            if seen is not None:
                seen.add(logp_all, logprobs, batch, mask, rows)
        if self.ranks is not None:  # each rank scored its slices (zeros elsewhere): the sum is every row's
            out = self.ranks.sum_tensor(out)
            if seen is not None:
                seen.reduce(self.ranks)
        return out, seen.stats() if seen is not None else {}

    def _mine(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a micro-batch's rows (all of them in one process)."""
        return rows if self.world == 1 else rows.tensor_split(self.world)[self.rank]


def _scalar(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP's total gradient norm) as the plain tensor every rank agrees on."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@dataclass
class Seen:
    """What the policy shows over the completion tokens it is scored on: its mean entropy, and the mean
    |learner − engine| log-prob where both are the same policy version (groups with staleness 0), which measures the
    engine's numerical mismatch alone (absent when no such group was seen)."""

    entropy: float = 0.0
    tokens: float = 0.0
    mismatch: float = 0.0
    fresh_tokens: float = 0.0

    def add(self, logp_all: torch.Tensor, logprobs: torch.Tensor, batch: Batch, mask: torch.Tensor, rows: torch.Tensor):
        m = mask[rows]
        self.entropy += float((-(logp_all.exp() * logp_all).sum(-1) * m).sum())
        self.tokens += float(m.sum())
        fresh = m * (batch.row_staleness[rows] == 0).to(m.dtype).unsqueeze(1)
        self.mismatch += float(((logprobs - batch.behaviour_logprobs[rows]).abs() * fresh).sum())
        self.fresh_tokens += float(fresh.sum())

    def reduce(self, ranks: Ranks) -> None:
        self.entropy, self.tokens, self.mismatch, self.fresh_tokens = ranks.sum(
            [self.entropy, self.tokens, self.mismatch, self.fresh_tokens]
        )

    def stats(self) -> dict[str, float]:
        out = {"entropy": self.entropy / max(self.tokens, 1.0)}
        if self.fresh_tokens:
            out["mismatch/logprob_abs_mean"] = self.mismatch / self.fresh_tokens
        return out


class Fused:
    """Proximal log-probs gathered from the training forward (one update per batch): each micro-batch's own, detached,
    with their importance weights; at the end, the same statistics the scoring pass reports."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask
        self.prox = torch.zeros_like(mask)
        self.seen = Seen()

    def add(
        self, logp_all: torch.Tensor, logprobs: torch.Tensor, batch: Batch, rows: torch.Tensor, lc: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.mask[rows]
        prox = logprobs * m
        self.prox[rows] = prox
        self.seen.add(logp_all, logprobs, batch, self.mask, rows)
        weights, _ = importance_weights(prox, batch.behaviour_logprobs[rows], m, cap=lc.tis_cap, mode=lc.is_mode)
        return prox, weights

    def finish(self, batch: Batch, lc: Any, ranks: Ranks | None) -> dict[str, float]:
        prox = self.prox
        if ranks is not None:
            prox = ranks.sum_tensor(prox)
            self.seen.reduce(ranks)
        _, w_stats = importance_weights(prox, batch.behaviour_logprobs, self.mask, cap=lc.tis_cap, mode=lc.is_mode)
        return self.seen.stats() | w_stats
