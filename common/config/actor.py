"""The actor's sections of the config tree: ``actor`` (the sampling loop) and ``sglang`` (its engine server). The
learner never reads them; what two roles need lives in :mod:`common.config.shared`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from common.config.shared import Section


class ActorConfig(Section):
    id: str = Field("", description="empty = <hostname>-<pid>")
    engine: Literal["local", "sim", "sglang"] = Field(
        "local",
        description="generation engine: local = transformers in-process; sglang = a SGLang server (see sglang.*); "
        "sim = random tokens, for load tests",
    )
    sim_tokens_per_s: float = Field(2000.0, gt=0, description="sim engine: tokens per second it produces")
    sim_rounds_in_flight: int = Field(
        1,
        ge=1,
        description="sim engine: rounds an actor keeps generating at once, each at sim_tokens_per_s, standing in for "
        "a server that batches concurrent requests (sglang.rounds_in_flight); 1 = one round at a time",
    )
    synchronous: bool = Field(
        False,
        description="after each round, wait for a newer weights version before sampling again: a synchronous RL "
        "loop, the baseline of benchmarks/overlap.py (B1); off = the asynchronous pipeline. Needs rounds that fill "
        "a batch (actor.prompts_per_round >= learner.batch_groups, actor.filter_zero_std off) and one actor, or the "
        "learner would wait for groups that actors waiting for its weights never send",
    )
    weight_updates: Literal["between_rounds", "in_flight"] = Field(
        "between_rounds",
        description="when an actor loads a newly published version: between_rounds = before its next round, so a "
        "round started just before a publish finishes on the old weights however long its answers are; in_flight "
        "= as soon as it learns of it, while its rounds are still being sampled (the local and sim engines between "
        "two decode steps, SGLang through /pause_generation, the update and /continue_generation), so that the "
        "rest of each answer comes from the new weights. Each answer then carries which version produced which "
        "tokens (the group message's versions), the learner leaves tokens older than learner.max_staleness out "
        "of the loss instead of dropping the answer, and no answer is thrown away for being slow. Buys fresher "
        "tokens and fewer stale drops on long answers; costs a pause of generation per version (the load itself) "
        "and, with in_flight_kv recompute, a prefill of every unfinished answer",
    )
    in_flight_kv: Literal["keep", "recompute"] = Field(
        "keep",
        description="weight_updates in_flight: what becomes of the keys and values cached for answers in flight. "
        "keep = the rest of an answer attends to keys computed with the old weights (as PipelineRL and AReaL do; "
        "the behaviour log-probs are what the engine computed that way, and the learner's importance weights "
        "correct for the difference); recompute = they are computed again with the new weights before the next "
        "token (the local engine prefills prompt and answer so far; SGLang retracts the requests), exact but a "
        "prefill of every unfinished answer per version",
    )
    prompts_per_round: int = Field(16, ge=1, description="prompts generated together in one engine call")
    prompt_sampling: Literal["cursor", "difficulty"] = Field(
        "cursor",
        description="which training problems a round draws: cursor = the shared cursor's shuffled passes, every "
        "problem once a pass; difficulty = the same passes, but a problem whose recent groups were all right or "
        "all wrong is passed over (drawn with the informative share of its recent groups, at least "
        "actor.difficulty_floor). Buys fewer zero-std groups to sample and filter once many problems are solved "
        "(or hopeless), from a problem's second draw on: a run that samples fewer groups than the training set has "
        "problems gains nothing; costs a Redis hash of every problem's recent outcomes and a lookup per round",
    )
    difficulty_floor: float = Field(
        0.1,
        gt=0,
        le=1,
        description="difficulty sampling: the least chance that a problem whose recent groups taught nothing is "
        "drawn when the cursor reaches it, so that one the model forgets (or starts to learn) comes back; lower "
        "saves more samples, and notices such a change later",
    )
    difficulty_window: int = Field(
        4,
        ge=1,
        le=64,
        description="difficulty sampling: how many recent groups of each problem its record keeps (one byte each)",
    )
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
    borrow_idle_cores: bool = Field(
        False,
        description="local engine: at each decode step, take one more torch thread per core of this machine the "
        "run's other processes left idle (the learner waiting for a batch), and give it back as soon as they use it "
        "again (Linux: /proc/stat against the actor's CPU time). Buys: sampling on both cores when an actor-bound "
        "run's learner waits (late in the SmolLM2 recipe, most groups all right); costs a clock read per decode "
        "step (docs/benchmarks.md). Useless where the roles have cores of their own",
    )
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
        "generate; 1 = one round at a time (see B6 in docs/sglang.md for the figures per CPU kind)",
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
