"""common.metrics: a private registry per process behind /metrics and /healthz, and endpoint files."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from common.metrics import ActorMetrics, LearnerMetrics, MetricsServer, gather_endpoints, register_endpoint


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
    finally:
        server.close()


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


def test_every_metric_is_documented_in_the_readme() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for cls in (LearnerMetrics, ActorMetrics):
        registry = CollectorRegistry()
        cls(registry)
        for family in registry.collect():
            name = family.name + ("_total" if family.type == "counter" else "")
            assert f"`{name}" in readme, f"{name} is not in the README's list of metrics"
