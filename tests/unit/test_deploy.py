"""docker-compose.yml, its Prometheus and Grafana files, .env.example and configs/compose.yaml: valid, and with the
properties a deployment relies on (no Docker engine is needed to check them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from common.config import load_config
from common.metrics import ActorMetrics, LearnerMetrics

REPO = Path(__file__).resolve().parents[2]


def compose() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_compose_file_follows_the_compose_specification(shared_dir: Path) -> None:
    import jsonschema

    schema = json.loads((shared_dir / "schemas" / "compose-spec.json").read_text())
    jsonschema.validate(compose(), schema)


def test_services_password_persistence_and_health() -> None:
    c = compose()
    assert set(c["services"]) == {"redis", "learner", "actor", "prometheus", "grafana"}
    redis = c["services"]["redis"]
    command = " ".join(redis["command"])
    assert "requirepass" in command and "/run/secrets/redis_password" in command and "--appendonly yes" in command
    assert redis["secrets"] == ["redis_password"]
    assert c["secrets"]["redis_password"] == {"environment": "REDIS_PASSWORD"}
    for name, service in c["services"].items():
        assert "healthcheck" in service, f"{name} has no healthcheck"
    for role in ("learner", "actor"):
        s = c["services"][role]
        assert s["depends_on"]["redis"]["condition"] == "service_healthy"
        env = s["environment"]
        assert env["GRPO_REDIS_PASSWORD"].startswith("${REDIS_PASSWORD") and env["GRPO_REDIS_URL"].startswith(
            "redis://redis:"
        )
        devices = s["deploy"]["resources"]["reservations"]["devices"]
        assert devices and devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    # The weights volume: written by the learner, read by every actor.
    assert "weights:/weights" in c["services"]["learner"]["volumes"]
    assert "weights:/weights:ro" in c["services"]["actor"]["volumes"]
    assert "weights" in c["volumes"]


def command_lines(service: dict) -> str:
    """Everything a service runs: its entrypoint, command and healthcheck, as one text."""
    parts = [service.get("entrypoint"), service.get("command"), service.get("healthcheck", {}).get("test")]
    return " ".join(" ".join(p) if isinstance(p, list) else p for p in parts if p)


def test_no_command_line_and_no_redis_variable_carries_the_password() -> None:
    # A command line is world-readable (`ps`, `docker inspect`); the Redis container reads the password from its
    # secret's file instead, and only the grpo roles, which take it from GRPO_REDIS_PASSWORD, see the variable.
    c = compose()
    for name, service in c["services"].items():
        assert "REDIS_PASSWORD" not in command_lines(service), name
    assert "REDIS_PASSWORD" not in json.dumps(c["services"]["redis"].get("environment", {}))


def test_actor_is_scalable() -> None:
    actor = compose()["services"]["actor"]
    assert "container_name" not in actor and "ports" not in actor  # `--scale actor=N` needs both absent
    assert actor.get("ipc") == "host"
    assert "actor.engine=sglang" in actor["command"]


def test_every_variable_is_in_env_example() -> None:
    used = set(re.findall(r"\$\{([A-Z0-9_]+)", (REPO / "docker-compose.yml").read_text()))
    listed = set(re.findall(r"^([A-Z0-9_]+)=", (REPO / ".env.example").read_text(), re.M))
    assert used and used <= listed, used - listed


def test_prometheus_finds_the_learner_and_every_actor_replica() -> None:
    prom = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j["dns_sd_configs"][0] for j in prom["scrape_configs"]}
    services = compose()["services"]
    for job, service in (("grpo-learner", "learner"), ("grpo-actor", "actor")):
        sd = jobs[job]
        assert sd["names"] == [service] and sd["type"] == "A"
        assert f"metrics.port={sd['port']}" in services[service]["command"]
        assert str(sd["port"]) in services[service]["expose"]


def metric_names() -> set[str]:
    names = set()
    for cls in (LearnerMetrics, ActorMetrics):
        registry = CollectorRegistry()
        cls(registry)
        for family in registry.collect():  # labelled metrics have no samples until used: names from the type
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
            names |= {family.name + suffix for suffix in suffixes}
    return names


def test_the_dashboard_shows_what_it_must_with_metrics_that_exist() -> None:
    dashboard = json.loads((REPO / "deploy" / "grafana" / "dashboards" / "grpo.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bgrpo_[a-z_]+", e)}
    assert used and used <= metric_names(), used - metric_names()
    text = " ".join(exprs)
    for needed in ("reward", "eval_accuracy", "frac_reward_zero_std", "clip_ratio", "_kl", "staleness",
                   "grpo_actor_groups_produced_total", "stream_groups", "weight_publish_seconds",
                   "weight_load_seconds"):  # fmt: skip
        assert needed in text, f"no panel queries {needed}"
    provisioning = yaml.safe_load((REPO / "deploy/grafana/provisioning/dashboards/grpo.yml").read_text())
    mounts = compose()["services"]["grafana"]["volumes"]
    assert f"./deploy/grafana/dashboards:{provisioning['providers'][0]['options']['path']}:ro" in mounts


def test_the_compose_run_config_loads() -> None:
    env = {"GRPO_MODEL_PATH": "Qwen/Qwen2.5-0.5B-Instruct", "GRPO_REDIS_URL": "redis://redis:6379/0"}
    cfg = load_config(REPO / "configs" / "compose.yaml", ["metrics.port=9400"], env=env)
    assert cfg.weights.dir == "/weights" and cfg.metrics.host == "0.0.0.0" and cfg.model.device == "cuda"


def test_compose_runs_the_config_named_by_grpo_config() -> None:
    services = compose()["services"]
    for role in ("learner", "actor"):
        command = services[role]["command"]
        assert command[command.index("--config") + 1] == "/app/${GRPO_CONFIG:-configs/compose.yaml}"
        assert "${GRPO_DATA_DIR:-./data}:/data:ro" in services[role]["volumes"]
        assert services[role]["environment"]["GRPO_TASK_PATH"] == "${GRPO_TASK_PATH:-}"
    listed = dict(re.findall(r"^([A-Z0-9_]+)=(.*)$", (REPO / ".env.example").read_text(), re.M))
    assert (REPO / listed["GRPO_CONFIG"]).is_file()


RECIPE = REPO / "configs" / "gsm8k-qwen2.5-0.5b.yaml"


def test_the_gsm8k_recipe_is_deepseekmaths_experiment_for_compose() -> None:
    env = {"GRPO_MODEL_PATH": "Qwen/Qwen2.5-0.5B-Instruct", "GRPO_REDIS_URL": "redis://redis:6379/0"}
    cfg = load_config(RECIPE, ["metrics.port=9400", "actor.engine=sglang"], env=env)
    t, lc = cfg.task, cfg.learner
    assert (t.name, t.path, t.subset, t.train_split, t.eval_split, t.eval_size) == (
        "dataset", "openai/gsm8k", "main", "train", "test", 0
    )  # fmt: skip
    assert "{question}" in t.prompt_template and "####" in t.prompt_template and cfg.grader.name == "gsm8k"
    assert 8 <= cfg.actor.group_size <= 16 and 5e-7 <= lc.lr <= 2e-6 and lc.beta == 0.0
    assert (lc.loss_type, lc.epsilon_low, lc.epsilon_high) == ("dapo", 0.2, 0.28) and cfg.actor.filter_zero_std
    # Mixed precision: float32 parameters (1e-6 updates survive), bfloat16 compute and published weights.
    assert (cfg.model.dtype, lc.autocast, cfg.weights.dtype) == ("float32", "bfloat16", "bfloat16")
    assert cfg.weights.dir == "/weights" and cfg.metrics.host == "0.0.0.0" and cfg.model.device == "cuda"
    # Offline, the same recipe reads a local copy (GRPO_TASK_PATH, .env.example) instead of the hub.
    offline = load_config(RECIPE, ["task.subset="], env={**env, "GRPO_TASK_PATH": "/data/gsm8k"})
    assert offline.task.path == "/data/gsm8k"


def test_the_gsm8k_recipe_reads_gsm8k(shared_dir: Path) -> None:
    pytest.importorskip("datasets", reason="the data extra (datasets) is not installed")
    from common.tasks import make_task

    cfg = load_config(RECIPE, [f"task.path={shared_dir / 'data' / 'gsm8k'}", "task.subset="], env={})
    task = make_task(cfg.task, cfg.run.seed)
    assert (len(task.train), len(task.eval)) == (7473, 1319)
    assert task.eval[0].prompt.startswith("Janet") and task.eval[0].prompt.endswith('after "####".')
    assert task.eval[0].reference.endswith("#### 18")


@pytest.mark.parametrize("name", ["learner.Dockerfile", "actor.Dockerfile"])
def test_dockerfiles_copy_the_package(name: str) -> None:
    text = (REPO / "docker" / name).read_text()
    for part in ("common", "actor", "learner", "grader", "configs", "pyproject.toml"):
        assert f"COPY {part}" in text or part in text
    assert 'pip install --no-cache-dir ".[data]"' in text  # datasets and parquet as task.path
