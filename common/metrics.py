"""Prometheus metrics of every role, in one file, and the small HTTP server that exposes them.

Each process owns a private :class:`CollectorRegistry` (no module-global default registry, so two roles in one test
process never collide) and serves ``/metrics`` (Prometheus text format), ``/healthz`` and ``/readyz`` (JSON; 200
while the role's loop moves, and for ``/readyz`` is past its start, 503 otherwise: :mod:`common.liveness`) on
``metrics.host:metrics.port``. Names start with ``grpo_`` and carry their unit.

A role's registry comes from :func:`process_registry`: besides the role's own metrics it holds the process's memory,
CPU and start time (``process_*``, ``python_info``) and ``grpo_build_info{version,run}``, the series dashboards and
alert rules join on to select a run. Counters are exported without ``_created`` twins (one series per counter, not
two). Every labelled counter is exported at 0 for each label value the code can produce before the first event, so
that ``rate()`` and ``increase()`` see the first event as an increase rather than as a new series; those values are
the ``Literal`` types below, which the code that produces them is typed with (mypy keeps the two in step).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from common.rollout import EpisodeEnd, GraderErrorKind
from common.schemas import DropReason, PromptPool

log = logging.getLogger(__name__)

# Every process imports this module before it creates a metric: the setting holds for all of them. A `_created`
# series per counter doubles what Prometheus stores and no dashboard or rule here reads it.
disable_created_metrics()

DISTRIBUTION = "grpo-pipeline"  # pyproject.toml's name: grpo_build_info's version is this distribution's

# The label values each labelled counter can take: the producers are typed with these (see the module docstring);
# those of a concept of their own live beside it (common.rollout: EpisodeEnd, GraderErrorKind; common.schemas:
# DropReason, PromptPool).
FilterReason = Literal["zero_std"]
WeightLoadFailure = Literal["unreadable", "mismatch", "path"]
BroadcastFallback = Literal["no_members", "not_ready", "join", "broadcast", "error"]
EngineEvent = Literal["cache_flush_retry", "version_from_reply"]
AlarmKind = Literal["clip_ratio", "zero_std"]

# Two bucket sets. Steps, generation rounds and grading take milliseconds to a minute. Moving whole weights does not:
# a 70B-parameter model is 140 GB in bf16 and its checkpoint (optimizer state included) about four times that; at
# the few hundred MB/s of a shared filesystem, writing, verifying or loading them takes minutes to half an hour.
# With the fast set those would all land in +Inf and every quantile above 60 s would read as 60 s.
_FAST = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_SLOW = (0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 900, 1200, 1800, 2700, 3600)


def build_version() -> str:
    """The installed distribution's version ("unknown" when run from a tree that was never installed)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


def process_registry(run: str) -> CollectorRegistry:
    """A role's registry: the process's own metrics (memory, CPU, open files, start time; the Python version) and
    ``grpo_build_info{version,run}`` = 1. ``run``: ``run.name``, the label the dashboard's run variable lists."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)  # reads /proc: absent (no samples) where there is none
    PlatformCollector(registry=registry)
    info = Gauge("grpo_build_info", "1, labelled with the build's version and the run's name", ["version", "run"],
                 registry=registry)  # fmt: skip
    info.labels(build_version(), run).set(1)
    return registry


_Labelled = TypeVar("_Labelled", Counter, Gauge)


def _at_zero(metric: _Labelled, values: Any) -> _Labelled:
    """Export ``metric`` at 0 for each label value of a ``Literal`` type (``values``) before its first event."""
    for value in get_args(values):
        metric.labels(value)
    return metric


class RedisMetrics:
    """Shared by every role: what the transport counts."""

    def __init__(self, registry: CollectorRegistry):
        self.errors = Counter("grpo_redis_errors", "Redis commands that failed", registry=registry)
        self.reconnects = Counter("grpo_redis_reconnects", "Redis reconnect attempts", registry=registry)


class LearnerMetrics(RedisMetrics):
    def __init__(self, registry: CollectorRegistry):
        super().__init__(registry)
        self._training(registry)
        self._groups(registry)
        self._weights(registry)
        self._health(registry)

    def _training(self, r: CollectorRegistry) -> None:
        """What each step did: its policy, rewards, clipping, KL, staleness, loss and speed."""
        self.step = Gauge("grpo_learner_step", "learner steps completed", registry=r)
        self.policy_version = Gauge("grpo_learner_policy_version", "policy version being trained", registry=r)
        self.reward = Gauge("grpo_learner_reward_mean", "mean reward of everything sampled for the step", registry=r)
        self.reward_trained = Gauge("grpo_learner_reward_trained_mean", "mean reward of trained groups", registry=r)
        self.frac_zero_std = Gauge(
            "grpo_learner_frac_reward_zero_std", "fraction of sampled groups with equal rewards", registry=r
        )
        self.clip_ratio = Gauge("grpo_learner_clip_ratio", "fraction of tokens clipped", ["region"], registry=r)
        self.kl = Gauge("grpo_learner_kl", "k3 KL estimate against the reference model", registry=r)
        self.entropy = Gauge("grpo_learner_entropy_nats", "mean token entropy of the policy", registry=r)
        self.staleness = Gauge("grpo_learner_staleness_versions", "policy versions behind", ["stat"], registry=r)
        self.loss = Gauge("grpo_learner_loss", "loss of the last step", registry=r)
        self.lr = Gauge("grpo_learner_lr", "learning rate", registry=r)
        self.tokens_per_s = Gauge("grpo_learner_tokens_per_second", "completion tokens trained per second", registry=r)
        self.step_seconds = Histogram("grpo_learner_step_seconds", "wall time of one step", buckets=_FAST, registry=r)

    def _groups(self, r: CollectorRegistry) -> None:
        """Where the groups went: trained, refused, dead-lettered, still in the stream, or unexplained."""
        self.groups_consumed = Counter("grpo_learner_groups_consumed", "groups trained on", registry=r)
        self.groups_dropped = _at_zero(
            Counter("grpo_learner_groups_dropped", "groups refused", ["reason"], registry=r), DropReason
        )
        self.groups_dead = Counter("grpo_learner_groups_dead", "messages dead-lettered", registry=r)
        self.updates_skipped = Counter(
            "grpo_learner_updates_skipped_nonfinite",
            "optimizer updates not applied because their gradient was not finite",
            registry=r,
        )
        self.stream_groups = Gauge(
            "grpo_learner_stream_groups", "groups in the stream: unread, or read and pending", ["state"], registry=r
        )
        # An alert rule reads it (deploy/prometheus/alerts.yml): above 0, groups were lost.
        self.unexplained = Gauge(
            "grpo_learner_accounting_unexplained_groups",
            "groups produced less trained, dropped, dead and in the stream (DESIGN's accounting equation): 0 unless "
            "groups were lost",
            registry=r,
        )

    def _weights(self, r: CollectorRegistry) -> None:
        """Publishing, broadcasting and checkpointing the weights."""
        self.publish_seconds = Histogram(
            "grpo_learner_weight_publish_seconds", "time to write and announce weights", buckets=_SLOW, registry=r
        )
        self.publish_bytes = Gauge(
            "grpo_learner_weight_publish_bytes", "size of the last published weights", registry=r
        )
        self.broadcast_seconds = Histogram(
            "grpo_learner_weight_broadcast_seconds",
            "weights.transport nccl: time from a round's start to its last bucket sent",
            buckets=_SLOW,
            registry=r,
        )
        self.broadcast_fallbacks = _at_zero(
            Counter(
                "grpo_learner_weight_broadcast_fallbacks",
                "versions written to disk because a broadcast could not happen (no_members, not_ready, join, "
                "broadcast, error)",
                ["reason"],
                registry=r,
            ),
            BroadcastFallback,
        )
        self.broadcast_superseded = Counter(
            "grpo_learner_weight_broadcast_superseded",
            "versions never broadcast because a newer one was published before their turn",
            registry=r,
        )
        self.checkpoint_seconds = Histogram(
            "grpo_learner_checkpoint_seconds", "time to write a checkpoint and acknowledge its groups", buckets=_SLOW,
            registry=r,
        )  # fmt: skip
        self.checkpoint_step = Gauge("grpo_learner_checkpoint_step", "step of the newest checkpoint", registry=r)

    def _health(self, r: CollectorRegistry) -> None:
        """Held-out accuracy, alarms, the reference model and the run's length."""
        self.eval_accuracy = Gauge("grpo_learner_eval_accuracy", "greedy accuracy on held-out prompts", registry=r)
        self.alarm = _at_zero(
            Gauge("grpo_learner_alarm", "1 while an alarm (clip_ratio, zero_std) is raised", ["kind"], registry=r),
            AlarmKind,
        )
        self.reference_loaded = Gauge(
            "grpo_learner_reference_model_loaded", "1 when a frozen reference model is in memory (beta > 0)", registry=r
        )
        # What the alert rules read (deploy/prometheus/alerts.yml): run_steps is set once, from the config.
        self.run_steps = Gauge("grpo_learner_run_steps", "run.steps: the step at which the learner ends", registry=r)


class ActorMetrics(RedisMetrics):
    def __init__(self, registry: CollectorRegistry):
        super().__init__(registry)
        self._rounds(registry)
        self._weights(registry)

    def _rounds(self, r: CollectorRegistry) -> None:
        """What each round sampled, graded, sent and filtered."""
        self.groups_produced = Counter("grpo_actor_groups_produced", "groups sent to the stream", registry=r)
        self.groups_filtered = _at_zero(
            Counter("grpo_actor_groups_filtered", "groups sampled and not sent", ["reason"], registry=r), FilterReason
        )
        self.groups_forwarded = Counter(
            "grpo_actor_groups_forwarded_zero_std", "zero-std groups sent because resampling hit its limit", registry=r
        )
        self.prompts_skipped = Counter(
            "grpo_actor_prompts_skipped", "training prompts longer than task.max_prompt_tokens, not sampled", registry=r
        )
        # Difficulty sampling's choices (actor.prompt_sampling=difficulty), by the problem's pool.
        self.prompts_taken, self.prompts_passed = (
            _at_zero(Counter(f"grpo_actor_prompts_{kind}", f"cursor positions whose problem a round {what}, by the "
                             "problem's pool (actor.prompt_sampling=difficulty)", ["pool"], registry=r), PromptPool)
            for kind, what in (("taken", "drew"), ("passed", "passed over"))
        )  # fmt: skip
        self.completions = Counter("grpo_actor_completions", "completions generated", registry=r)
        # env.name tool: how episodes ended (common.rollout.EpisodeEnd), and the tool calls answered in them
        self.episodes = _at_zero(
            Counter("grpo_actor_episodes", "episodes sampled, by how they ended", ["end"], registry=r), EpisodeEnd
        )
        self.tool_calls = Counter("grpo_actor_tool_calls", "tool calls answered within episodes", registry=r)
        self.tokens = Counter("grpo_actor_tokens_generated", "completion tokens generated", registry=r)
        self.reward = Gauge("grpo_actor_reward_mean", "mean reward of the last round", registry=r)
        self.generation_seconds = Histogram(
            "grpo_actor_generation_seconds",
            "engine time per round, from its start to its samples",
            buckets=_FAST,
            registry=r,
        )
        self.grader_seconds = Histogram(
            "grpo_actor_grader_seconds", "grading time per round", buckets=_FAST, registry=r
        )
        self.grader_errors = _at_zero(
            Counter("grpo_actor_grader_errors", "answers scored 0 as grading failed, by kind", ["kind"], registry=r),
            GraderErrorKind,
        )

    def _weights(self, r: CollectorRegistry) -> None:
        """Loading new weights, the engine's replies, and waiting for the learner."""
        self.weight_load_seconds = Histogram(
            "grpo_actor_weight_load_seconds",
            "time to verify and load new weights (transport: disk or nccl)",
            ["transport"],
            buckets=_SLOW,
            registry=r,
        )
        self.weight_load_failures = _at_zero(
            Counter(
                "grpo_actor_weight_load_failures",
                "announced versions not loaded, the engine's weights kept (reason: unreadable, mismatch, path)",
                ["reason"],
                registry=r,
            ),
            WeightLoadFailure,
        )
        self.weights_malformed = Counter(
            "grpo_actor_weight_announcements_malformed",
            "distinct malformed weights:latest hashes seen (ignored until the learner's next announcement)",
            registry=r,
        )
        self.policy_version = Gauge("grpo_actor_policy_version", "policy version the actor samples with", registry=r)
        self.backpressure_seconds = Counter(
            "grpo_actor_backpressure_wait_seconds", "time spent waiting for the learner to catch up", registry=r
        )
        self.engine_events = _at_zero(
            Counter(
                "grpo_actor_engine_events",
                "engine replies survived (sglang: cache_flush_retry, a weights load whose cache flush had to be "
                "asked again; version_from_reply, /generate reporting another weight_version than /model_info)",
                ["kind"],
                registry=r,
            ),
            EngineEvent,
        )


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            body, ctype, code = generate_latest(self.server.registry), CONTENT_TYPE_LATEST, 200
        elif path in ("/healthz", "/readyz"):
            ok, info = self.server.health()
            # /healthz: alive (the liveness probe); /readyz: alive and past the start (the readiness probe).
            up = ok and (path == "/healthz" or info.get("ready", True))
            body, ctype, code = json.dumps({"ok": ok, **info}).encode(), "application/json", 200 if up else 503
        else:
            body, ctype, code = b"not found: try /metrics, /healthz or /readyz\n", "text/plain", 404
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # scrapes are not worth a log line each
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], registry: CollectorRegistry, health: Callable[[], tuple[bool, dict]]):
        super().__init__(addr, _Handler)
        self.registry = registry
        self.health = health


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on a background thread. Port 0 binds any free port; :attr:`url`
    says which. ``health`` returns ``(ok, info)``: ``/healthz`` answers 200 while ok, ``/readyz`` while ok and
    ``info["ready"]`` (a role's :class:`common.liveness.Liveness` report), both 503 otherwise, with ``info``."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        health: Callable[[], tuple[bool, dict]] = lambda: (True, {}),
    ):
        try:
            self._server = _Server((host, port), registry, health)
        except OSError as e:  # another process's port (a second learner waiting on this machine): the user's choice
            if e.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
                raise
            from common.config import ConfigError  # here: a grader's worker imports this module, never the config

            raise ConfigError(
                f"config error: metrics.port: cannot listen on {host}:{port} ({e.strerror}); give each process on "
                "this machine a port of its own, or 0 for any free one"
            ) from e
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = str(self._server.server_address[0]), self._server.server_address[1]
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://{shown}:{port}/metrics"

    @property
    def listening(self) -> str:
        """Where it listens, in words: ``http://0.0.0.0:9400/metrics (every address)`` when bound to all of them (a
        container's, reached by Prometheus over the compose network), else the URL itself."""
        host = str(self._server.server_address[0]) or "0.0.0.0"
        if host in ("0.0.0.0", "::"):
            shown = f"[{host}]" if ":" in host else host
            return f"http://{shown}:{self._server.server_address[1]}/metrics (every address)"
        return self.url

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# --- endpoints: where each process's /metrics is -----------------------------------------------------------------


def register_endpoint(
    run_dir: str | os.PathLike[str],
    role: str,
    name: str,
    url: str,
    *,
    pid: int | None = None,
    key: str = "metrics_url",
) -> Path:
    """Record a process's URL under ``<run_dir>/endpoints.d/``; ``grpo run`` gathers them. By default this process and
    its metrics URL; a server it launched gives its own ``pid`` and ``key="url"``."""
    d = Path(run_dir) / "endpoints.d"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{role}-{name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"role": role, "name": name, "pid": pid or os.getpid(), key: url}))
    os.replace(tmp, path)
    return path


def gather_endpoints(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    d = Path(run_dir) / "endpoints.d"
    if not d.is_dir():
        return []
    out = [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))]
    return sorted(out, key=lambda e: (e["role"] != "learner", e["name"]))
