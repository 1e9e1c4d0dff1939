"""The ``local`` engine: transformers on this process's CPU or GPU (the embedded default), an
:class:`actor.engines.base.Engine` that loads versions mid-round itself (in-flight updates: between two decode steps,
keeping or recomputing the cache, actor.engines.recompute) and takes weights over NCCL as one rank of the group."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from actor.engines.base import BetweenRounds, Capabilities, Updates, load_if_due
from actor.engines.recompute import generate_recomputing
from common.config import Config
from common.hardware import describe_device, resolve_bf16
from common.idle_cores import core_borrower
from common.model.generation import generate, pad_token_id, stop_token_ids
from common.model.loading import load_pretrained
from common.model.lora import adapter_state, is_lora, same_shape, served_config, wrap, wrap_as
from common.rollout import Sample
from common.schemas import WeightsAnnouncement
from common.weights import WeightsError, WeightsMismatch, check_fits, confined, load_into, load_state_dict
from common.weights.adapters import base_identity, base_specs, check_base, load_adapter, read_config
from common.weights.nccl import NcclRound, abort_group, close_group, open_group, unflatten, wait_for

log = logging.getLogger(__name__)


class LocalEngine:
    # weights.transport nccl: this process joins the update group itself, as one rank
    capabilities = Capabilities(loads_mid_round=True, nccl_ranks=1)
    # actor.weight_updates in_flight: asked between two decode steps whether to load a new version (set by the actor)
    updates: Updates | None = None

    def __init__(self, cfg: Config, seed: int):
        self.cfg = cfg
        self.tokenizer, self.model = load_pretrained(cfg.model.path, cfg.model.dtype, cfg.model.device)
        self.stop_ids = stop_token_ids(self.model, self.tokenizer)
        self.pad_id = pad_token_id(self.tokenizer, self.stop_ids)
        self.version = 0
        self.base_intact = True  # the weights are model.path's: a LoRA version may be applied over them
        self._base: dict[str, str] | None = None  # model.path's identity, read at the first LoRA version
        self._group: tuple[str, Any] | None = None
        self._staged: tuple[str, dict[str, torch.Tensor]] | None = None  # a round's weights, until it is announced
        self._generating = False  # a round is being sampled: loads must keep the model object (in-place copies)
        self.device = next(self.model.parameters()).device
        self.bf16 = resolve_bf16(cfg.actor.autocast, self.device.type)
        if cfg.actor.autocast == "auto":
            log.info("actor.autocast auto: %s on %s", "bfloat16" if self.bf16 else "off (float32 compute)",
                     describe_device(self.device.type))  # fmt: skip
        # actor.borrow_idle_cores: a thread more per core the learner left idle (waiting for a batch), chosen at
        # each decode step.
        self.cores = core_borrower(cfg.actor.borrow_idle_cores and self.device.type == "cpu", cfg.actor.torch_threads)
        torch.manual_seed(seed)

    def generate(self, prompts: Sequence[Sequence[int]], n: int, *, greedy: bool = False) -> list[list[Sample]]:
        """With in-flight updates (``self.updates``), each sample says which version produced which tokens: a version
        due mid-round is loaded between two decode steps, the cached keys and values kept (``actor.in_flight_kv``
        keep) or recomputed by a prefill of the unfinished answers (recompute, actor.engines.recompute)."""
        updates, limit = (None if greedy else self.updates), self.cfg.sampling.max_new_tokens
        if updates is None:
            return self._generate(prompts, n, limit, greedy=greedy)
        if self.cfg.actor.in_flight_kv == "recompute":
            return generate_recomputing(lambda p, k, most, ask: self._generate(p, k, most, interrupt=ask),
                                        prompts, n, limit, updates)  # fmt: skip
        return self._generate(prompts, n, limit, between_steps=lambda: load_if_due(updates))

    def generate_versioned(
        self, prompts: Sequence[Sequence[int]], n: int, *, greedy: bool = False
    ) -> tuple[list[list[Sample]], int | None]:
        """The engine is the truth about its own version: nothing to report beyond what it holds."""
        return self.generate(prompts, n, greedy=greedy), None

    def failed(self) -> str | None:
        return None  # (no server of its own)

    def _generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        max_new_tokens: int,
        *,
        greedy: bool = False,
        between_steps: Callable[[], object] | None = None,
        interrupt: Callable[[], bool] | None = None,
    ) -> list[list[Sample]]:
        """``between_steps`` runs after each step's log-probs are recorded, before the next forward (a load there
        changes the weights of the next token on); either hook makes the samples carry their tokens' versions."""
        cores = self.cores.adjust if self.cores is not None else None
        hooks = [h for h in (cores, between_steps) if h is not None]
        versioned = between_steps is not None or interrupt is not None
        self._generating = between_steps is not None
        # actor.autocast: the forward passes in bfloat16 where it is native; the log-probs come out in float32.
        with torch.autocast(device_type=self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            try:
                return generate(
                    self.model,
                    prompts,
                    n=n,
                    max_new_tokens=max_new_tokens,
                    stop_ids=self.stop_ids,
                    pad_id=self.pad_id,
                    temperature=None if greedy else self.cfg.sampling.temperature,
                    each_step=(lambda: [h() for h in hooks]) if hooks else None,
                    version=(lambda: self.version) if versioned else None,
                    interrupt=interrupt,
                )
            finally:
                self._generating = False

    def load(self, ann: WeightsAnnouncement) -> int:
        """All or nothing: a version that is unreadable, outside ``weights.dir`` or does not fit the model raises
        WeightsError before a tensor of the model is touched, and the version stays the one it holds. A LoRA
        version (``lora-safetensors``) is an adapter over the base this engine loaded from ``model.path``."""
        state, nbytes = load_state_dict(ann, root=self.cfg.weights.dir)
        if ann.format == "lora-safetensors":
            self._apply_adapter(ann, state)
        else:
            self._replace_base(state)
        self._fresh_casts()
        self.version = ann.version
        return nbytes

    def _fresh_casts(self) -> None:
        """After the weights changed: autocast keeps the bfloat16 copy of each float32 weight it cast until its
        region ends, and a load mid-round (in-flight updates, keep) happens inside the region of the whole
        ``generate`` call, so without this the Linear layers would go on computing with the old version's copies
        while norms and embeddings (not cast) took the new one's. The cache is this thread's: loads run in the
        thread that samples."""
        torch.clear_autocast_cache()

    def _replace_base(self, state: dict[str, torch.Tensor]) -> None:
        """Whole weights: after adapters, checked against the base first, then the adapter goes and they replace
        the base (all or nothing either way)."""
        if is_lora(self.model):
            check_fits(self.model.get_base_model(), state, base_specs(self.model))
            self._whole_model_between_rounds()
            self.model = self.model.unload()
        load_into(self.model, state)
        self.base_intact = False

    def _apply_adapter(self, ann: WeightsAnnouncement, state: dict[str, torch.Tensor]) -> None:
        """The adapter ``state`` over the base: the first one wraps the model with peft's layers (shaped by the
        version's ``adapter_config.json``), later ones are copied in. Refused, the model untouched, when the
        adapter was trained on another base (``base.json``'s digest) or the weights here are no longer the base."""
        directory = confined(ann.uri, self.cfg.weights.dir)
        if not self.base_intact:
            raise WeightsMismatch(f"weights v{ann.version} are a LoRA adapter, and this engine holds whole weights "
                                  "of an earlier version instead of the base: restart the actor")  # fmt: skip
        if self._base is None:
            self._base = base_identity(self.cfg.model.path)
        check_base(self._base, directory, ann.version)
        config = read_config(directory)
        if not is_lora(self.model):
            self._whole_model_between_rounds()
            self.model = wrap_as(self.model, config)
        elif not same_shape(served_config(self.model), config):
            self._whole_model_between_rounds()
            self._reshape(directory, config, state)  # another rank, other layers or another alpha
            return
        load_adapter(self.model, state)

    def _whole_model_between_rounds(self) -> None:
        """Mid-round (in-flight updates), a load may only copy tensors into the model being sampled: one that wraps
        or unwraps it in adapter layers waits for the round's end."""
        if self._generating:
            raise BetweenRounds("a load that replaces the model object waits for the round's end")

    def _reshape(self, directory: Path, config: Any, state: dict[str, torch.Tensor]) -> None:
        """An adapter of another shape or scale than the one served (a run resumed with other settings): the model
        is wrapped anew for it; when it does not fit, the adapter served before is put back as it was."""
        before = (served_config(self.model), adapter_state(self.model))
        self.model = wrap_as(self.model.unload(), config)
        try:
            load_adapter(self.model, state)
        except WeightsError:
            self.model = wrap(self.model.unload(), before[0]).eval()
            load_adapter(self.model, before[1])
            raise

    # weights.transport nccl: the same group and buckets a SGLang server takes (common/weights/nccl.py)

    def join_group(self, nccl_round: NcclRound, rank_offset: int, timeout_s: float) -> None:
        try:
            pg = open_group(address=nccl_round.address, port=nccl_round.port, world_size=nccl_round.world_size,
            rank=rank_offset,
                            group_name=nccl_round.group, backend=nccl_round.backend, timeout_s=timeout_s,
                            collective_timeout_s=max(3600.0, 10 * timeout_s))  # fmt: skip
        except Exception as e:  # (torch's DistError and friends)
            raise WeightsError(f"joining update group {nccl_round.group}: {e}") from None
        self._group = (nccl_round.group, pg)

    def leave_group(self, group: str) -> None:
        if self._group is not None and self._group[0] == group:
            close_group(self._group[1])
            self._group = None

    def receive(self, nccl_round: NcclRound, timeout_s: float) -> int:
        """Every bucket, kept aside until :meth:`commit` (the round's announcement) loads them at once: a failed
        broadcast, or one its learner never announced, leaves the model as it was."""
        import torch.distributed as dist

        if self._group is None or self._group[0] != nccl_round.group:
            raise WeightsError(f"not in the update group {nccl_round.group}")
        device = self.cfg.model.device if nccl_round.backend == "nccl" else "cpu"
        state: dict[str, torch.Tensor] = {}
        for b in nccl_round.buckets:
            flat = torch.empty(b.nbytes, dtype=torch.uint8, device=device)
            work = dist.broadcast(flat, group_src=0, group=self._group[1], async_op=True)
            try:
                wait_for(work, timeout_s, "broadcast")
            except TimeoutError as e:  # the model is untouched: the version comes from disk instead
                abort_group(self._group[1])
                self._group = None
                raise WeightsError(f"a bucket of weights v{nccl_round.version} did not arrive: {e}") from None
            state |= unflatten(flat, b)
        self._staged = (nccl_round.id, state)
        return sum(b.nbytes for b in nccl_round.buckets)

    def commit(self, nccl_round: NcclRound) -> None:
        """The round was announced: its weights replace the model's (learner.lora sends adapters by disk: over NCCL
        come whole weights only)."""
        staged, self._staged = self._staged, None
        if staged is None or staged[0] != nccl_round.id:
            raise WeightsError(f"weights v{nccl_round.version} of round {nccl_round.id} were not received")
        self._replace_base(staged[1])
        self._fresh_casts()
        self.version = nccl_round.version

    def discard(self, nccl_round: NcclRound) -> None:
        """Never announced: the weights received are dropped, the model's stay (its version too)."""
        self._staged = None

    def close(self) -> None:
        if self._group is not None:
            self.leave_group(self._group[0])
