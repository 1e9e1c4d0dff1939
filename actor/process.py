"""The actor process: its Redis, metrics, grader and engine opened, the :class:`actor.loop.Actor` run until it stops,
and everything closed again. An engine that fails exits with code 1, so that a supervisor restarts the actor."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time

import torch
from prometheus_client import CollectorRegistry

from actor.engines import make_engine
from actor.engines.base import Engine, EngineError
from actor.loop import Actor
from common.config import Config
from common.liveness import Liveness
from common.metrics import ActorMetrics, MetricsServer, process_registry, register_endpoint
from common.model.importing import prepare_model_path
from common.model.limits import prompt_token_limit
from common.rollout import END_REASONS
from common.transport import ActorTransport
from env.episodes import Episodes, open_episodes
from grader.open import open_grader

log = logging.getLogger("actor")


def run_actor(cfg: Config) -> int:
    torch.set_num_threads(cfg.actor.torch_threads)
    prepare_model_path(cfg)
    actor_id = cfg.actor.id or f"{socket.gethostname()}-{os.getpid()}"
    registry = process_registry(cfg.run.name)
    metrics = ActorMetrics(registry)
    transport = ActorTransport(
        cfg.redis, cfg.run.name, on_error=metrics.errors.inc, on_reconnect=metrics.reconnects.inc
    )
    transport.ping()
    if (g := cfg.sampling.group_size) <= 3:
        log.warning("group size %d: with so few answers grader noise becomes a full ±1 advantage", g)

    # /healthz: the loop's beats within metrics.stall_after_s (common.liveness); the engine's start has its own bound.
    liveness = Liveness(cfg.metrics.stall_after_s, role="actor", id=actor_id, version=None)
    grader = open_grader(cfg.grader)
    server = MetricsServer(registry, cfg.metrics.host, cfg.metrics.port, liveness.report)
    register_endpoint(cfg.run.dir, "actor", actor_id, server.url)
    engine: Engine | None = None
    episodes: Episodes | None = None
    try:
        # Loading the model, or launching a SGLang server and waiting up to sglang.ready_timeout_s for it.
        liveness.beat("starting the engine", cfg.sglang.ready_timeout_s + cfg.metrics.stall_after_s, starting=True)
        engine = make_engine(cfg, seed=cfg.run.seed * 1_000_003 + os.getpid(), name=actor_id,
                             on_event=lambda kind: metrics.engine_events.labels(kind).inc())  # fmt: skip
        episodes = open_episodes(cfg, engine.tokenizer, engine.stop_ids)  # env.name tool
        actor = Actor(cfg, actor_id, transport, engine, grader, metrics, prompt_token_limit(cfg), episodes, liveness)
        stop = actor.stop
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        log.info("actor %s: engine %s, group size %d, %d prompts per round, metrics on %s", actor_id,
                 cfg.actor.engine, cfg.sampling.group_size, cfg.actor.prompts_per_round, server.listening)  # fmt: skip
        started = time.perf_counter()
        reason = actor.run()
        sent = f"{actor.groups_sent} groups sent in {actor.rounds} rounds{episode_ends(registry)}"
        split = time_split(registry, time.perf_counter() - started)
        log.info("actor %s stopped (%s): %s; %s", actor_id, reason, sent, split)
        return 0
    except EngineError as e:  # the engine's server is gone or answers nonsense: say so, and let it be restarted
        log.error("actor %s: engine %s failed: %s; exiting", actor_id, cfg.actor.engine, e)
        return 1
    finally:
        if engine is not None:
            engine.close()
        if episodes is not None:
            episodes.close()
        grader.close()
        server.close()
        transport.close()


def time_split(registry: CollectorRegistry, seconds: float) -> str:
    """Where the actor's time went: generating, waiting for room (backpressure: the learner is the slower half, and
    an actor sharing its cores could lend them), and the rest (grading, sending, loading weights)."""
    generating = registry.get_sample_value("grpo_actor_generation_seconds_sum") or 0.0
    waiting = registry.get_sample_value("grpo_actor_backpressure_wait_seconds_total") or 0.0
    rest = max(seconds - generating - waiting, 0.0)
    return f"{seconds:.0f} s: {generating:.0f} s generating, {waiting:.0f} s waiting for room, {rest:.0f} s the rest"


def episode_ends(registry: CollectorRegistry) -> str:
    """``env.name`` tool: how the actor's episodes ended and the tool calls answered, for its last log line (empty
    without episodes)."""
    ends = {end: int(registry.get_sample_value("grpo_actor_episodes_total", {"end": end}) or 0) for end in END_REASONS}
    if not any(ends.values()):
        return ""
    calls = int(registry.get_sample_value("grpo_actor_tool_calls_total") or 0)
    return f"; episodes ended: {', '.join(f'{k} {v}' for k, v in ends.items() if v)}; {calls} tool calls answered"
