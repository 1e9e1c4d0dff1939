"""common.metrics: a private registry per process behind /metrics and /healthz, and endpoint files; what a fresh
process exports (process metrics, build info, labelled counters at 0, no `_created` series); histogram buckets."""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, get_args

import pytest
from prometheus_client import CollectorRegistry

from actor.loop import Actor
from common.children import wait_until
from common.liveness import Liveness
from common.metrics import (
    ActorMetrics,
    AlarmKind,
    BroadcastFallback,
    DropReason,
    EngineEvent,
    FilterReason,
    GraderErrorKind,
    LearnerMetrics,
    MetricsServer,
    WeightLoadFailure,
    build_version,
    gather_endpoints,
    register_endpoint,
)


def test_metrics_and_health_over_http() -> None:
    registry = CollectorRegistry()
    m = LearnerMetrics(registry)
    m.step.set(7)
    m.groups_dropped.labels("stale").inc(3)
    healthy = [True]
    server = MetricsServer(registry, "127.0.0.1", 0, lambda: (healthy[0], {"role": "learner"}))
    try:
        body = urllib.request.urlopen(server.url, timeout=5).read().decode()
        assert "grpo_learner_step 7.0" in body
        assert 'grpo_learner_groups_dropped_total{reason="stale"} 3.0' in body
        assert "grpo_redis_errors_total" in body
        assert "python_gc" not in body  # the private registry holds ours only
        health = server.url.replace("/metrics", "/healthz")
        assert json.loads(urllib.request.urlopen(health, timeout=5).read()) == {"ok": True, "role": "learner"}
        healthy[0] = False
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(health, timeout=5)
        assert e.value.code == 503
        assert json.loads(e.value.read()) == {"ok": False, "role": "learner"}  # the body says why
    finally:
        server.close()


def test_healthz_is_the_loops_liveness_and_readyz_its_start_over() -> None:
    """A role serves its Liveness report: alive while starting (/healthz 200, /readyz 503), ready once the loop
    works, and both 503 once it stalls."""
    clock = [0.0]
    liveness = Liveness(60.0, clock=lambda: clock[0], role="actor", id="a-1")
    server = MetricsServer(CollectorRegistry(), "127.0.0.1", 0, liveness.report)

    def code(path: str) -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(server.url.replace("/metrics", path), timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        liveness.beat("starting the engine", 900.0, starting=True)
        clock[0] = 600.0  # a SGLang server still loading its model: within the start's own bound
        assert code("/healthz")[0] == 200 and code("/readyz")[0] == 503
        liveness.beat("sampling a round", version=3)
        status, info = code("/readyz")
        assert status == 200 and info["ok"] and info["ready"] and info["doing"] == "sampling a round"
        assert info["role"] == "actor" and info["id"] == "a-1" and info["version"] == 3
        clock[0] += 61.0
        for path in ("/healthz", "/readyz"):
            status, info = code(path)
            assert status == 503 and not info["ok"] and info["quiet_s"] == 61.0 and info["stall_after_s"] == 60.0
            assert "stuck_at" in info  # where the loop's thread is (here: this test's, serving the request)
    finally:
        server.close()


def test_the_start_line_says_where_it_listens() -> None:
    # Bound to every address (a container's, for Prometheus), the log says so; endpoints.json keeps a URL to use here.
    for host, listening in (("127.0.0.1", "http://127.0.0.1:{port}/metrics"),
                            ("0.0.0.0", "http://0.0.0.0:{port}/metrics (every address)")):  # fmt: skip
        server = MetricsServer(CollectorRegistry(), host, 0)
        try:
            port = int(server.url.rsplit(":", 1)[1].split("/")[0])
            assert server.listening == listening.format(port=port)
            assert server.url == f"http://127.0.0.1:{port}/metrics"
        finally:
            server.close()


def test_a_port_in_use_is_a_config_error_naming_the_field() -> None:
    """Two processes on one machine given the same metrics.port (a second learner serves /healthz while it waits for
    the run's lease): one line naming the field, exit 2, not a traceback."""
    from common.config import ConfigError

    first = MetricsServer(CollectorRegistry(), "127.0.0.1", 0)
    try:
        port = int(first.url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(ConfigError, match=rf"^config error: metrics.port: cannot listen on 127.0.0.1:{port} "):
            MetricsServer(CollectorRegistry(), "127.0.0.1", port)
    finally:
        first.close()


def test_two_roles_in_one_process_do_not_collide() -> None:
    LearnerMetrics(CollectorRegistry())
    LearnerMetrics(CollectorRegistry())
    ActorMetrics(CollectorRegistry())


def test_endpoints_are_gathered_learner_first(tmp_path: Path) -> None:
    register_endpoint(tmp_path, "actor", "actor-2", "http://127.0.0.1:2/metrics")
    register_endpoint(tmp_path, "learner", "learner", "http://127.0.0.1:1/metrics")
    register_endpoint(tmp_path, "actor", "actor-1", "http://127.0.0.1:3/metrics")
    assert [e["name"] for e in gather_endpoints(tmp_path)] == ["learner", "actor-1", "actor-2"]
    assert {"role", "name", "pid", "metrics_url"} == set(gather_endpoints(tmp_path)[0])


def test_every_metric_is_documented_in_the_guide_to_watching_a_run() -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "watching.md").read_text()
    for cls in (LearnerMetrics, ActorMetrics):
        registry = CollectorRegistry()
        cls(registry)
        for family in registry.collect():
            name = family.name + ("_total" if family.type == "counter" else "")
            assert f"`{name}" in readme, f"{name} is not in docs/watching.md's list of metrics"


# A process that only builds a role's registry, as `grpo learner` and `grpo actor` do, and serves it.
SERVE = """
import sys, threading
from common.metrics import ActorMetrics, LearnerMetrics, MetricsServer, process_registry, register_endpoint
role, run_dir = sys.argv[1], sys.argv[2]
registry = process_registry("run-a")
(LearnerMetrics if role == "learner" else ActorMetrics)(registry)
server = MetricsServer(registry, "127.0.0.1", 0)
register_endpoint(run_dir, role, role, server.url)
threading.Event().wait()
"""

# Every labelled counter (and the learner's alarm gauge) with the label values the code can produce.
LABELLED = {
    "learner": {
        "grpo_learner_groups_dropped_total": ("reason", DropReason),
        "grpo_learner_weight_broadcast_fallbacks_total": ("reason", BroadcastFallback),
        "grpo_learner_alarm": ("kind", AlarmKind),
    },
    "actor": {
        "grpo_actor_groups_filtered_total": ("reason", FilterReason),
        "grpo_actor_grader_errors_total": ("kind", GraderErrorKind),
        "grpo_actor_weight_load_failures_total": ("reason", WeightLoadFailure),
        "grpo_actor_engine_events_total": ("kind", EngineEvent),
    },
}


def fresh_scrape(role: str, tmp_path: Path, processes: Any) -> str:
    """/metrics of a process that has counted nothing yet."""
    run_dir = tmp_path / role
    processes.start([sys.executable, "-c", SERVE, role, str(run_dir)], tmp_path / f"{role}.log")
    assert wait_until(lambda: bool(gather_endpoints(run_dir)), 30), (tmp_path / f"{role}.log").read_text()
    url = gather_endpoints(run_dir)[0]["metrics_url"]
    return str(urllib.request.urlopen(url, timeout=5).read().decode())


@pytest.mark.parametrize("role", ["learner", "actor"])
def test_a_fresh_process_exports_process_metrics_build_info_and_every_label_at_zero(
    role: str, tmp_path: Path, processes: Any
) -> None:
    body = fresh_scrape(role, tmp_path, processes)
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_start_time_seconds"):
        assert re.search(rf"^{name} [0-9.e+]+$", body, re.M), f"{name} missing"
    assert "python_info{" in body
    assert f'grpo_build_info{{run="run-a",version="{build_version()}"}} 1.0' in body
    assert build_version() != "unknown"  # the distribution is installed: its version is known
    assert "_created" not in body  # one series per counter, in every process
    for name, (label, values) in LABELLED[role].items():
        for value in get_args(values):
            assert f'{name}{{{label}="{value}"}} 0.0' in body, f"{name}{{{label}={value!r}}} is not at 0"


def test_slow_histograms_resolve_half_an_hour_and_fast_ones_milliseconds() -> None:
    registry = CollectorRegistry()
    learner, actor = LearnerMetrics(registry), ActorMetrics(CollectorRegistry())
    slow = [learner.checkpoint_seconds, learner.publish_seconds, learner.broadcast_seconds,
            actor.weight_load_seconds.labels("disk")]  # fmt: skip
    for histogram in slow:
        bounds = [b for b in histogram._upper_bounds if b != float("inf")]  # type: ignore[attr-defined]
        assert max(bounds) >= 1800 and {600, 1200, 1800} <= set(bounds), histogram
    fast = [learner.step_seconds, actor.generation_seconds, actor.grader_seconds]
    for histogram in fast:
        assert min(histogram._upper_bounds) <= 0.001  # type: ignore[attr-defined]
    # A 25-minute checkpoint lands below 30 minutes, not in +Inf.
    learner.checkpoint_seconds.observe(25 * 60)
    text = "\n".join(f"{s.name}{s.labels} {s.value}" for m in registry.collect() for s in m.samples)
    assert "grpo_learner_checkpoint_seconds_bucket{'le': '1800.0'} 1.0" in text
    assert "grpo_learner_checkpoint_seconds_bucket{'le': '1200.0'} 0.0" in text


def test_a_long_backpressure_wait_is_counted_while_it_lasts() -> None:
    """The stream-full alert reads rate() of the wait counter: a wait that has not ended yet must already count."""
    metrics = ActorMetrics(CollectorRegistry())
    actor = Actor.__new__(Actor)
    pubsub = SimpleNamespace(get_message=lambda timeout: time.sleep(0.05))
    never = SimpleNamespace(is_set=lambda: False, is_done=lambda: False)  # no stop request, the run goes on
    actor.__dict__.update(stop=never, transport=never, heartbeat=lambda: None, receiver=None, _pubsub=pubsub,
                          metrics=metrics, engine=SimpleNamespace(failed=lambda: None),
                          liveness=Liveness(60.0))  # fmt: skip
    seen: list[float] = []

    def blocked() -> bool:  # still waiting: what has the counter said so far?
        seen.append(metrics.backpressure_seconds._value.get())
        return len(seen) < 4

    actor._wait(blocked)
    assert seen[0] == 0 and seen[3] >= 0.1  # counted during the wait, before it ended


def test_actor_time_split_reads_the_actors_own_counters() -> None:
    """The actor's last log line says where its time went, from the same counters Prometheus scrapes."""
    from actor.process import time_split
    from common.metrics import ActorMetrics, process_registry

    registry = process_registry("run")
    metrics = ActorMetrics(registry)
    metrics.generation_seconds.observe(30.0)
    metrics.generation_seconds.observe(10.0)
    metrics.backpressure_seconds.inc(12.0)
    assert time_split(registry, 60.0) == "60 s: 40 s generating, 12 s waiting for room, 8 s the rest"
