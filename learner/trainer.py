"""One learner step's optimisation, with no I/O: ``advantages → old log-probs → mini-batch updates → statistics``.

Departures from the textbook, each a config choice (the loss itself is learner.loss):
- rewards get DAPO's soft overlong penalty before grouping (``shaping.overlong_cache``: each actor computes it once,
  filters on it and sends it with the group), and completions cut off at
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
- the tokens an environment wrote into a multi-turn episode (tool output) are the model's input but never in the
  loss: ``assemble`` leaves them out of ``loss_mask``, which every count and figure below reads (learner.batch);
- the learning rate warms up linearly over ``warmup_steps`` optimizer steps, then stays or decays (learner.schedule).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from common.config import Config
from common.grpo.advantages import group_advantages
from common.grpo.logprobs import gather_tokens, scaled_log_softmax
from common.hardware import describe_device, resolve_bf16
from common.idle_cores import adjust_within, core_borrower
from common.model.lora import is_lora
from common.schemas import FilteredStats, GroupMessage
from learner.batch import Batch, assemble, env_share, micro_batches, sampled_reward_stats, version_spread
from learner.distributed import Ranks
from learner.loss import grpo_loss, importance_weights, micro_batch_weight
from learner.packing import pack, unpack
from learner.packing import positions as packed_positions
from learner.proximal import FusedProximal, UpdateInputs
from learner.schedule import lr_factor
from learner.tally import PolicyStats, UpdateTally

log = logging.getLogger(__name__)
NOTHING_FILTERED = FilteredStats()


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
        # What requires grad: every weight, or with learner.lora the adapter's alone (the optimizer's state is then
        # the adapter's size, and the base never moves).
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=lc.lr, betas=lc.betas, weight_decay=lc.weight_decay)
        self.lora = is_lora(model)
        total = cfg.run.steps * lc.updates_per_batch
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, warmup=lc.warmup_steps, total=total, schedule=lc.lr_schedule)
        )
        self.generator = torch.Generator().manual_seed(cfg.run.seed)
        # Proximal log-probs from the training forward when a batch gets one update (see the module docstring);
        # False forces the separate scoring pass (the tests compare the two).
        self.fuse_proximal = lc.old_logprobs == "proximal" and lc.updates_per_batch == 1
        self.bf16 = resolve_bf16(lc.autocast, self.device.type)
        # learner.borrow_idle_cores: a thread more per core the actors left idle, chosen before each block of the
        # model, forward and backward (one process only: torchrun's ranks each have their own cores).
        self.cores = core_borrower(
            lc.borrow_idle_cores and self.device.type == "cpu" and ranks is None, lc.torch_threads
        )
        if self.cores is not None:
            adjust_within(model, self.cores.adjust)
        if lc.autocast == "auto":
            log.info("learner.autocast auto: %s on %s", "bfloat16" if self.bf16 else "off (float32 compute)",
                     describe_device(self.device.type))  # fmt: skip

    def autocast(self) -> Any:
        """Forward passes in bfloat16 under ``learner.autocast`` while parameters and AdamW's state keep
        ``model.dtype``: with float32 parameters, updates far smaller than the weights (lr 1e-6) are not rounded
        away as they are in bfloat16 parameters. Log-softmax and the loss are computed in float32 either way."""
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def step(
        self, groups: list[GroupMessage], version: int, filtered: FilteredStats = NOTHING_FILTERED
    ) -> dict[str, float]:
        """Train on one batch of groups (``filtered``: what actors filtered out since the previous batch, for the
        reward figures); returns the step's statistics (metrics.jsonl keys)."""
        if self.cores is not None:
            # Threads for the step's first forward (the reference model's, which has no hooks), and the borrowed
            # time before this step left out of its figure.
            self.cores.adjust()
        borrowed = self.cores.borrowed_s if self.cores is not None else 0.0
        batch = assemble(groups, self.pad_id, version).to(self.device)
        mask = batch.loss_mask
        if self.cfg.learner.mask_truncated_completions:
            # DAPO's overlong filtering: a cut-off answer is neither right nor wrong, so it teaches nothing.
            mask = mask * (~batch.truncated).to(mask.dtype).unsqueeze(1)
        # In-flight updates: tokens sampled more than max_staleness versions ago are left out of the loss (the
        # answer stays, its reward counts in its group's advantages), as a group that old would have been dropped.
        fresh_enough = (batch.token_staleness <= self.cfg.learner.max_staleness).to(mask.dtype)
        stale_tokens = float((mask * (1 - fresh_enough)).sum())
        mask = mask * fresh_enough
        adv, shaping = self.advantages(batch)
        old, is_weights, shown = (None, None, {}) if self.fuse_proximal else self.old_logprobs(batch, mask)
        ref = self.reference_logprobs(batch, mask)
        stats, first = self.update(UpdateInputs(batch, mask, adv, old, is_weights, ref))
        stats |= shown or first  # behavior mode: what the policy looked like, from the first mini-batch
        stats |= sampled_reward_stats(groups, filtered) | shaping
        stats |= {
            "completions/mean_length": float(batch.completion_lengths.mean()),
            "completions/truncated_frac": float(batch.truncated.float().mean()),
            "staleness/mean": float(batch.staleness.float().mean()),
            "staleness/max": float(batch.staleness.max()),
            **version_spread(batch),
            **env_share(groups),
            "tokens/stale_masked": stale_tokens,
            "groups_forwarded_zero_std": float(sum(g.zero_std for g in groups)),
            "tokens": float(mask.sum()),
        }
        if self.cores is not None:  # the seconds of this step's forwards run with a borrowed thread
            stats["time/borrowed_s"] = self.cores.borrowed_s - borrowed
        return stats

    def advantages(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Group advantages of the (shaped) rewards."""
        rewards, shaping = batch.rewards, {}
        if batch.penalties is not None:  # computed once, by the actors that shaped their rewards (and filtered on them)
            rewards = rewards + batch.penalties.to(rewards.dtype)
            shaping = {"reward/overlong_penalty": float(batch.penalties.mean())}
        if self.cfg.run.shuffle_rewards:  # the control experiment: rewards no longer belong to their completions
            rewards = rewards[torch.randperm(len(rewards), generator=self.generator).to(rewards.device)]
        a = self.cfg.learner.advantage
        return group_advantages(rewards, batch.group_size, scale=a.scale, ddof=a.ddof, eps=a.eps).float(), shaping

    def reference_logprobs(self, batch: Batch, mask: torch.Tensor) -> torch.Tensor | None:
        """The KL penalty's reference log-probs (beta > 0): the frozen starting policy, or with learner.lora the
        policy with its adapter switched off, which is that very policy (the base never trains) at no memory."""
        if self.lora and self.cfg.learner.beta > 0:
            with self.model.disable_adapter():
                return self._scored(self.model, batch, mask)[0]
        return self._scored(self.reference, batch, mask)[0] if self.reference is not None else None

    def old_logprobs(
        self, batch: Batch, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """The ratio's denominator, the importance weights, and (proximal mode) what the current policy shows."""
        lc = self.cfg.learner
        if lc.old_logprobs == "behavior":
            return batch.behavior_logprobs, None, {}
        prox, shown = self._scored(self.model, batch, mask, PolicyStats())
        weights, w_stats = importance_weights(prox, batch.behavior_logprobs, mask, cap=lc.tis_cap, mode=lc.is_mode)
        return prox, weights, shown | w_stats

    def update(self, inputs: UpdateInputs) -> tuple[dict[str, float], dict[str, float]]:
        """``updates_per_batch`` AdamW steps over shuffled mini-batches of ``grad_accum`` micro-batches each (sizes
        as even as possible). Returns the metrics (token-weighted means) and, in behavior mode, what the first
        micro-batch saw before any update (proximal mode measured it in its scoring pass already). ``inputs.old``
        None: the proximal log-probs are each micro-batch's own, before the batch's single update
        (:class:`FusedProximal`)."""
        lc = self.cfg.learner
        tally = UpdateTally(lr=self.lr)
        fused = FusedProximal(inputs.mask, PolicyStats(), lc) if inputs.old is None else None
        first = PolicyStats() if lc.old_logprobs == "behavior" else None
        order = torch.randperm(len(inputs.batch.rewards), generator=self.generator).to(self.device)
        self.model.train()
        for rows in order.tensor_split(lc.updates_per_batch):
            self._one_update(inputs, rows, tally, fused, first)
        self.model.eval()
        if self.ranks is not None:
            tally.reduce(self.ranks)
            if first is not None:
                first.reduce(self.ranks)
        if fused is not None:
            return tally.stats(), fused.finish(inputs.batch, self.ranks)
        return tally.stats(), first.stats() if first is not None else {}

    def _one_update(
        self,
        inputs: UpdateInputs,
        rows: torch.Tensor,
        tally: UpdateTally,
        fused: FusedProximal | None,
        first: PolicyStats | None,
    ) -> None:
        """One optimizer step on the mini-batch ``rows``: its micro-batches' gradients accumulated, then applied
        unless their norm is not finite."""
        step_tokens = inputs.mask[rows].sum()
        update_loss = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        for micro in self._micro_batches(rows, inputs.batch, tally):
            # The first micro-batch with tokens, judged on the whole micro-batch so that every rank takes its slice
            # of the same one.
            watch = first if first is not None and not first.slices and float(inputs.mask[micro].sum()) > 0 else None
            update_loss += self._micro_batch(inputs, rows, micro, step_tokens, tally, fused, watch)
        params = self.optimizer.param_groups[0]["params"]
        grad_norm = _scalar(torch.nn.utils.clip_grad_norm_(params, self.cfg.learner.grad_clip))
        if not torch.isfinite(grad_norm):
            # One NaN/inf would poison every weight from here on: skip the update, and say so in the metrics.
            tally.skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
        else:
            tally.applied(update_loss, grad_norm.item(), self.lr)
            self.optimizer.step()
        self.scheduler.step()

    def _micro_batches(self, rows: torch.Tensor, batch: Batch, tally: UpdateTally | None = None) -> list[torch.Tensor]:
        """The micro-batches of ``rows``: ``grad_accum`` equal splits, or by ``micro_batch_tokens`` (rows of like
        length together, each forward within the budget). The loss's weights (learner.loss.micro_batch_weight) make
        either add up to the mini-batch's gradient. ``tally`` counts the forwards' padding."""
        lc, lengths = self.cfg.learner, batch.row_lengths
        if lc.micro_batch_tokens:
            groups = micro_batches(rows, lengths, lc.micro_batch_tokens, self.world)
        else:
            groups = list(rows.tensor_split(lc.grad_accum))
        if tally is not None:
            for g in groups:
                mine = self._mine(g)
                if len(mine):
                    tally.forwarded(self._positions(lengths[mine]), int(lengths[mine].sum()))
        return groups

    def _positions(self, lengths: torch.Tensor) -> int:
        """The positions one forward computes for rows of these lengths: rows x the longest, or packed rows."""
        if self.cfg.learner.pack_sequences:
            return packed_positions(lengths.tolist())
        return len(lengths) * int(lengths.max())

    def _micro_batch(
        self,
        inputs: UpdateInputs,
        rows: torch.Tensor,
        micro: torch.Tensor,
        step_tokens: torch.Tensor,
        tally: UpdateTally,
        fused: FusedProximal | None,
        watch: PolicyStats | None,
    ) -> float:
        """Forward and backward this rank's slice of the micro-batch ``micro``; ``watch`` records what the policy
        shows on it. Returns the slice's (weighted) loss."""
        lc, batch, mask = self.cfg.learner, inputs.batch, inputs.mask
        mine = self._mine(micro)
        logp_all, logprobs = self._forward(self.model, batch, mine)
        if watch is not None:
            watch.add(logp_all.detach(), logprobs.detach(), batch, mask, mine)
        old_mine, w_mine = self._old_of(inputs, fused, logp_all, logprobs, mine)
        loss, m = grpo_loss(
            logprobs,
            old_mine,
            inputs.adv[mine],
            mask[mine],
            loss_type=lc.loss_type,
            epsilon_low=lc.epsilon_low,
            epsilon_high=lc.epsilon_high,
            beta=lc.beta,
            ref_logprobs=None if inputs.ref is None else inputs.ref[mine],
            max_completion_length=self.cfg.sampling.max_new_tokens,
            is_weights=w_mine,
            # dapo: the optimizer step's token count, so accumulation gives one big mini-batch's gradient
            num_tokens=step_tokens,
        )
        loss = loss * micro_batch_weight(lc.loss_type, mask, mine, micro, rows)
        # FSDP averages the ranks' gradients; their losses add up to the micro-batch's, so scale back.
        (loss * self.world if self.world > 1 else loss).backward()
        tally.add(m, float(mask[mine].sum()))
        return loss.item()

    def _old_of(
        self,
        inputs: UpdateInputs,
        fused: FusedProximal | None,
        logp_all: torch.Tensor,
        logprobs: torch.Tensor,
        mine: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The ratio's denominator for the rows ``mine``, and their importance weights: the proximal log-probs of
        this very forward (fused), or those the step was given."""
        if fused is not None:
            return fused.add(logp_all.detach(), logprobs.detach(), inputs.batch, mine)
        assert inputs.old is not None
        return inputs.old[mine], None if inputs.is_weights is None else inputs.is_weights[mine]

    @torch.no_grad()
    def _scored(
        self, model: Any, batch: Batch, mask: torch.Tensor, watch: PolicyStats | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Log-probs of the batch's tokens under ``model`` in eval mode (no grad; 0 outside the mask), scored in
        chunks the size of a training micro-batch (so ``grad_accum`` bounds this pass's memory too), and, with
        ``watch``, what the policy shows (see :class:`PolicyStats`)."""
        lc = self.cfg.learner
        out = torch.zeros_like(mask)
        every = torch.arange(len(batch.rewards), device=mask.device)
        chunks = (
            micro_batches(every, batch.row_lengths, lc.micro_batch_tokens, self.world)
            if lc.micro_batch_tokens
            else every.tensor_split(lc.updates_per_batch * lc.grad_accum)
        )
        for chunk in chunks:
            rows = self._mine(chunk)
            logp_all, logprobs = self._forward(model, batch, rows)
            out[rows] = logprobs * mask[rows]
            if watch is not None:
                watch.add(logp_all, logprobs, batch, mask, rows)
        if self.ranks is not None:  # each rank scored its slices (zeros elsewhere): the sum is every row's
            out = self.ranks.sum_tensor(out)
            if watch is not None:
                watch.reduce(self.ranks)
        return out, watch.stats() if watch is not None else {}

    def _forward(self, model: Any, batch: Batch, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``model``'s log-probs of every token at the sampling temperature, and of the batch's own tokens, for
        ``rows``: one forward and one log-softmax, shared by the loss (or the scoring) and the entropy. The forward
        is cut to the rows' longest (rows are right-padded: what follows it is padding for every one of them, and a
        causal model's log-probs of the tokens before it do not depend on it); every token's log-probs cover those
        positions, the batch's own tokens' are padded back with zeros to the batch's width."""
        # A rank's slice may be empty (a micro-batch of fewer rows than ranks): it still runs the forward FSDP needs.
        width = int(batch.row_lengths[rows].max()) if len(rows) else batch.input_ids.shape[1]
        ids = batch.input_ids[rows, :width]
        with self.autocast():
            if self.cfg.learner.pack_sequences and len(rows):
                logits = self._packed_logits(model, ids, batch.row_lengths[rows])
            else:
                logits = model(input_ids=ids, attention_mask=batch.attention_mask[rows, :width]).logits
        logp_all = scaled_log_softmax(logits[:, :-1], self.cfg.sampling.temperature)
        logprobs = gather_tokens(logp_all, ids[:, 1:])
        return logp_all, torch.nn.functional.pad(logprobs, (0, batch.input_ids.shape[1] - width))

    def _packed_logits(self, model: Any, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The logits of the rows ``ids`` from one forward of them packed (learner.packing), in the rows' layout.
        No attention mask and no cache: transformers then reads the sequences' bounds off ``position_ids``. sdpa
        and eager take packed rows as they are (a block-diagonal mask per row); transformers' flash-attention path
        finds packed sequences only in a batch of one row, so for it the packed rows go end to end in one."""
        packed = pack(ids, lengths, self.pad_id)
        p_ids, p_pos = packed.input_ids, packed.position_ids
        flash = "flash" in str(getattr(model.config, "_attn_implementation", ""))
        if flash:
            p_ids, p_pos = p_ids.reshape(1, -1), p_pos.reshape(1, -1)
        logits = model(input_ids=p_ids, position_ids=p_pos, use_cache=False).logits
        return unpack(logits.view(*packed.input_ids.shape, -1) if flash else logits, packed)

    def _mine(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a micro-batch's rows (all of them in one process)."""
        return rows if self.world == 1 else rows.tensor_split(self.world)[self.rank]


def _scalar(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP's total gradient norm) as the plain tensor every rank agrees on."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
