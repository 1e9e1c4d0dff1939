"""The learner's sections of the config tree: ``learner`` (the optimiser, batches, staleness, evaluation),
``learner.advantage`` and ``checkpoint``. The actors never read them; what two roles need lives in
:mod:`common.config.shared`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from common.config.shared import Section


class AdvantageConfig(Section):
    scale: Literal["group", "batch", "none"] = Field("group", description="divide by the group's std, batch's, or 1")
    ddof: Literal[0, 1] = Field(0, description="0 = population std (the seed's table), 1 = Bessel (TRL)")
    eps: float = Field(1e-6, ge=0, description="added to the std before dividing (TRL uses 1e-4)")


class LoraConfig(Section):
    """LoRA adapters, with the conventions of the peft library (which does the work). Buys: the optimizer holds the
    adapter's state only, and a published version is the adapter (kilobytes to megabytes instead of the model);
    with beta > 0 the KL reference is the same model with the adapter switched off, no second copy. Costs: two
    small matrix products per adapted layer in every forward, and a policy that moves only within the adapter's
    rank (usually a larger lr than full fine-tuning's)."""

    rank: int = Field(
        0,
        ge=0,
        description="the adapter's rank r; 0 = off, every weight is trained and published. One learner process "
        "(refused under torchrun); with actor.engine sglang the servers must run on GPUs (SGLang's LoRA layers need "
        "CUDA: a CPU server is refused), the local engine serves adapters anywhere",
    )
    alpha: float = Field(32.0, gt=0, description="peft's lora_alpha: the update is scaled by alpha / rank")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="peft's lora_dropout, on the adapter's input in training forwards only: the scoring forward has "
        "none, so with dropout the ratio does not start at 1 (keep 0 for RL, as the model's own dropout is off)",
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="the linear layers that get an adapter: peft's names (e.g. [q_proj, v_proj]) or all-linear "
        "(every linear layer but the output head); a SGLang server is launched with the same list",
    )


class LearnerConfig(Section):
    batch_groups: int = Field(32, ge=1, description="groups per learner step")
    updates_per_batch: int = Field(
        4, ge=1, description="optimizer steps per batch: the shuffled batch is split into this many mini-batches"
    )
    grad_accum: int = Field(
        1, ge=1, description="micro-batches per optimizer step (gradient accumulation): bounds activation memory"
    )
    micro_batch_tokens: int = Field(
        0,
        ge=0,
        description="a token budget per forward instead of grad_accum's equal row splits: each mini-batch's rows, "
        "longest first, go into micro-batches of at most this many positions (rows x the longest row, per rank); "
        "rows of like length share a forward, so less of it is padding (the step's padding_frac says how much), at "
        "the cost of more, smaller forwards when lengths vary. The gradient is the same as one big mini-batch's for "
        "dapo, grpo and dr_grpo; bnpo's token mean is per micro-batch by definition, so its gradient changes with "
        "the split. 0 = grad_accum's splits",
    )
    pack_sequences: bool = Field(
        False,
        description="each forward's rows laid end to end in as few rows of its longest row's length as fit, each "
        "sequence with its own positions and attending only to itself (transformers' block-diagonal mask, or a "
        "flash-attention kernel's sequence bounds): the linear layers skip most padding when lengths are uneven "
        "(padding_frac counts the packed rows), the attention costs no more than unpacked; the loss and gradient "
        "are the unpacked ones up to float rounding; the logits are copied back to the rows' layout (a second copy "
        "for a moment). Pays with long, uneven answers; buys little with short ones",
    )
    lr: float = Field(7e-5, gt=0, description="AdamW peak learning rate")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="after warm-up: constant, or a linear or cosine decay towards 0 at the end of the run"
    )
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up from 0 to lr")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="gradient norm clipped to this before each optimizer step")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = Field(
        "dapo", description="loss aggregation; see learner/loss.py for each formula"
    )
    epsilon_low: float = Field(0.2, ge=0, lt=1, description="clip ratio below at 1 - epsilon_low (negative advantages)")
    epsilon_high: float = Field(0.28, ge=0, description="clip ratio above at 1 + epsilon_high (DAPO clip-higher)")
    beta: float = Field(0.0, ge=0, description="KL penalty weight; 0 = no reference model")
    advantage: AdvantageConfig = AdvantageConfig()
    lora: LoraConfig = LoraConfig()
    max_staleness: int = Field(2, ge=0, description="drop groups more than this many versions behind")
    old_logprobs: Literal["proximal", "behavior"] = Field(
        "proximal",
        description="ratio denominator: the learner's own log-probs at the start of the step, or the engine's",
    )
    tis_cap: float = Field(2.0, ge=1, description="C: importance weights are min(π_prox / π_behaviour, C)")
    is_mode: Literal["truncate", "mask"] = Field(
        "truncate",
        description="truncate: weight min(w, C); mask: weight w inside [1/C, C], tokens outside dropped (weight 0)",
    )
    mask_truncated_completions: bool = Field(
        False, description="leave completions cut off at max_new_tokens out of the loss (DAPO overlong filtering)"
    )
    alarm_window: int = Field(10, ge=1, description="steps a condition must hold before its alarm is raised")
    alarm_clip_ratio: float = Field(
        0.2, gt=0, le=1, description="alarm when clip_ratio/region_mean stays above this: lr likely too large"
    )
    alarm_zero_std: float = Field(
        0.9, gt=0, le=1, description="alarm when frac_reward_zero_std stays above this: prompts too easy or too hard"
    )
    publish_every: int = Field(1, ge=1, description="publish weights every this many steps (and at the last)")
    eval_every: int = Field(
        20, ge=1, description="greedy held-out evaluation every this many steps (and at 0 and the last)"
    )
    log_every: int = Field(
        1,
        ge=0,
        description="a progress line in the learner's log (step, reward, accuracy, zero-std, staleness, groups/s, "
        "elapsed, ETA) every this many steps and at the last; what `docker compose logs learner` shows; 0 = none",
    )
    read_block_ms: int = Field(1000, ge=1, description="longest single wait for new groups (XREADGROUP BLOCK)")
    dead_letter_keep: int = Field(
        100_000,
        ge=1,
        description="malformed messages kept in the dead-letter stream, about the newest (stats count them all)",
    )
    if_held: Literal["wait", "exit"] = Field(
        "wait",
        description="a learner started on a run another live learner holds: wait for it (saying for whom: host, "
        "pid, since when) until it ends or gives up its lease, or exit at once with code 4; one learner trains a run",
    )
    held_wait_s: float = Field(
        3600.0,
        gt=0,
        description="if_held wait: the longest wait, then exit code 4 (a supervisor that restarts it waits again, "
        "rather than spinning)",
    )
    torch_threads: int = Field(1, ge=1, description="torch CPU threads of the learner")
    borrow_idle_cores: bool = Field(
        False,
        description="before each block of the model (forward and backward) and each decode step of an evaluation, "
        "take one more torch thread per core of this machine the run's other processes left idle since the last "
        "choice (an actor waiting for room), and give it back as soon as they use it again (Linux: /proc/stat "
        "against the learner's CPU time, capped by a cgroup quota). Buys: the SmolLM2 recipe's actor waits half "
        "the time, and 6 steps of B2's headroom task took 0.88x as long, evaluations 0.6x (docs/benchmarks.md). "
        "Costs: a clock read per block; a borrowed thread that meets a returning actor runs slow until the next "
        "choice (at most 0.5 s later). Useless where the roles have cores of their own",
    )
    min_step_s: float = Field(
        0.0,
        ge=0,
        description="pad each training step to at least this many seconds: a learner step of controlled time, "
        "for benchmarks (B1 overlap); 0 = off",
    )
    autocast: Literal["off", "bfloat16", "auto"] = Field(
        "off",
        description="bfloat16: the learner's forward passes (training, scoring, evaluation) in bfloat16 while its "
        "parameters and optimizer state stay in model.dtype; with model.dtype float32 this is mixed precision, and "
        "updates far smaller than the weights (lr 1e-6) are kept instead of rounded away; auto: bfloat16 where the "
        "device computes it natively (a GPU; a CPU with AMX or AVX512-BF16), off elsewhere (an AVX2-only CPU "
        "emulates bfloat16: a SmolLM2 step took 15x float32's time on an AVX2-only AMD EPYC); the learner's log "
        "says which it took",
    )

    @model_validator(mode="after")
    def _one_split(self) -> LearnerConfig:
        if self.micro_batch_tokens and self.grad_accum > 1:
            raise ValueError(
                "grad_accum and micro_batch_tokens both split the micro-batches: set grad_accum to 1 with a "
                "token budget, or micro_batch_tokens to 0"
            )
        return self

    @model_validator(mode="after")
    def _fresh_enough(self) -> LearnerConfig:
        # Between two publishes the learner advances publish_every versions while actors keep the old weights: with
        # more than max_staleness + 1 of them every group would arrive too stale and the run would wait forever.
        if self.publish_every > self.max_staleness + 1:
            raise ValueError(
                f"publish_every ({self.publish_every}) must be at most max_staleness + 1 ({self.max_staleness + 1}): "
                "otherwise every group is too stale by the time it is trained"
            )
        return self


class CheckpointConfig(Section):
    dir: str = Field("", description="where checkpoints go; empty = <run.dir>/checkpoints")
    every: int = Field(
        1,
        ge=1,
        description="checkpoint every this many steps (and on SIGTERM and at the last step); groups are "
        "acknowledged once a checkpoint covers them, so a crash retrains at most this many steps, and up to this many "
        "x learner.batch_groups read groups wait in the stream; a checkpoint writes the model and the optimizer's "
        "state, so raise it for large models",
    )
    keep: int = Field(2, ge=1, description="checkpoints kept on disk (older ones are deleted)")
    dedup_window: int = Field(
        1000,
        ge=1,
        description="steps for which trained group ids are remembered to drop a group delivered twice (Redis holds "
        "up to this many x batch_groups ids, about 100 bytes each)",
    )
