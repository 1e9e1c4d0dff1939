"""The config tree's role sections: the actor's (``actor``, ``sglang``) and the learner's (``learner``,
``checkpoint``). No other role reads them; what two roles need lives in :mod:`common.config_sections`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from common.config_sections import Section


class ActorConfig(Section):
    id: str = Field("", description="empty = <hostname>-<pid>")
    engine: Literal["local", "sim", "sglang"] = Field(
        "local",
        description="generation engine: local = transformers in-process; sglang = a SGLang server (see sglang.*); "
        "sim = random tokens, for load tests",
    )
    sim_tokens_per_s: float = Field(2000.0, gt=0, description="sim engine: tokens per second it produces")
    synchronous: bool = Field(
        False,
        description="after each round, wait for a newer weights version before sampling again: a synchronous RL "
        "loop, the baseline of benchmarks/overlap.py (B1); off = the asynchronous pipeline. Needs rounds that fill "
        "a batch (actor.prompts_per_round >= learner.batch_groups, actor.filter_zero_std off) and one actor, or the "
        "learner would wait for groups that actors waiting for its weights never send",
    )
    prompts_per_round: int = Field(16, ge=1, description="prompts generated together in one engine call")
    filter_zero_std: bool = Field(True, description="DAPO dynamic sampling: drop groups whose rewards are all equal")
    max_consecutive_filtered: int = Field(
        64,
        ge=1,
        description="after this many filtered groups in a row, the next zero-std group is sent, flagged",
    )
    max_stream_groups: int = Field(
        0,
        ge=0,
        description="backpressure: actors wait while the stream holds this many unread groups; 0 = 2 x batch_groups "
        "(fewer still when the learner could not train them within learner.max_staleness)",
    )
    stop_send_timeout_s: float = Field(
        60.0,
        ge=0,
        description="on SIGTERM, how long an actor waits for room in the stream to send the round in hand whole; "
        "past it the round is discarded and counted as groups_discarded:stopped (keep it under the supervisor's "
        "grace period)",
    )
    torch_threads: int = Field(1, ge=1, description="torch CPU threads of each actor process")
    autocast: Literal["off", "bfloat16", "auto"] = Field(
        "off",
        description="the local engine's forward passes in bfloat16 (weights stay in model.dtype); auto: bfloat16 "
        "where the device computes it natively (a GPU; a CPU with AMX or AVX512-BF16), off elsewhere; the actor's "
        "log says which it took. SGLang's CPU kernels compute in bfloat16 whatever this says",
    )


# SGLang's CPU backend as it runs with its CPU kernel: its default attention backend (intel_amx) needs a newer kernel
# than the one SGLang 0.5.23 was released with (the release that matches the kernel, 0.5.17, was a fifth faster with
# it in B6, but its scheduler dies on a weight update whose cache flush finds requests running, which 0.5.23 answers
# with HTTP 400), float32 has no rmsnorm kernel and `auto` would load an fp32 checkpoint as float16 (log-probs off by
# nats), the overlap scheduler is GPU-only, the KV cache takes a fraction of the machine's memory, not of a GPU's, and
# an idle scheduler would otherwise poll at 100 % of a core, which the learner and the other actors on the same CPUs
# need.
SGLANG_CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--dtype", "bfloat16",
                   "--disable-overlap-schedule", "--mem-fraction-static", "0.05", "--sleep-on-idle")  # fmt: skip


class SGLangConfig(Section):
    url: str = Field(
        "", description="a running SGLang server, http://host:30000; empty = the actor launches one as its child"
    )
    python: str = Field(
        "",
        description="the interpreter that launches the server (SGLang pins its own torch, so it has a venv of its "
        "own); empty = .venv-sglang/bin/python of this checkout when scripts/sglang_env.sh made it, else this "
        "process's interpreter (SGLang's image); env GRPO_SGLANG_PYTHON",
    )
    launch_module: str = Field(
        "sglang.launch_server", description="module run as `python -m MODULE --model-path ... --port ...` to launch"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where a launched server runs: auto = cuda when this process sees a GPU, else cpu"
    )
    cpu_args: list[str] = Field(
        default_factory=lambda: list(SGLANG_CPU_ARGS),
        description="launch arguments on the CPU (with SGLANG_USE_CPU_ENGINE=1 in its environment): SGLang's CPU "
        "backend with the attention and dtype its CPU kernel supports, and a small KV cache",
    )
    launch_args: list[str] = Field(
        default_factory=list, description="extra launch arguments, e.g. [--mem-fraction-static, '0.8']"
    )
    cpu_preload: bool = Field(
        True,
        description="on the CPU, LD_PRELOAD what SGLang's CPU recipe runs with, where installed: Intel's OpenMP "
        "(libiomp5 of the server's venv, pip's intel-openmp) and the tcmalloc and TBB allocators (Debian's "
        "libtcmalloc-minimal4, libtbbmalloc2); scripts/sglang_env.sh installs them",
    )
    rounds_in_flight: int = Field(
        2,
        ge=1,
        description="rounds an actor keeps generating at once on its server (each with its own reservation of "
        "room): the server batches them continuously, and the actor grades and sends one while the others "
        "generate; 1 = one round at a time (see B6 in the README for the figures per CPU kind)",
    )
    requests: Literal["n", "separate"] = Field(
        "n",
        description="n: one request per prompt with sampling_params.n (one prefill); separate: the prompt repeated "
        "once per sample in a batch",
    )
    ready_timeout_s: float = Field(900.0, gt=0, description="how long to wait for /health after connecting or launch")
    timeout_s: float = Field(600.0, gt=0, description="HTTP time limit of one /generate or weight update")
    retries: int = Field(5, ge=0, description="attempts per request on connection errors and 5xx, with backoff")
    flush_attempts: int = Field(
        5,
        ge=1,
        description="a server that loaded new weights but could not flush its prefix cache yet (requests still "
        "running) is asked to flush this many times, each waiting up to flush_timeout_s for it to go idle",
    )
    flush_timeout_s: float = Field(10.0, gt=0, description="how long one /flush_cache waits for the server to idle")


class AdvantageConfig(Section):
    scale: Literal["group", "batch", "none"] = Field("group", description="divide by the group's std, batch's, or 1")
    ddof: Literal[0, 1] = Field(0, description="0 = population std (the seed's table), 1 = Bessel (TRL)")
    eps: float = Field(1e-6, ge=0, description="added to the std before dividing (TRL uses 1e-4)")


class LearnerConfig(Section):
    batch_groups: int = Field(32, ge=1, description="groups per learner step")
    updates_per_batch: int = Field(
        4, ge=1, description="optimizer steps per batch: the shuffled batch is split into this many mini-batches"
    )
    grad_accum: int = Field(
        1, ge=1, description="micro-batches per optimizer step (gradient accumulation): bounds activation memory"
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
