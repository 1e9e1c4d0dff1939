"""deploy/kubernetes: every manifest is a valid Kubernetes object (checked against the Kubernetes OpenAPI schemas
that the `kubernetes-validate` package ships, no cluster or kubectl needed), and the manifests run what
docker-compose.yml runs."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.config import load_config

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30"  # the oldest version still common in managed clusters; the manifests use nothing newer


def kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def manifests() -> list[str]:
    """The resources that are files here (the others are directories with a kustomization of their own)."""
    return [f for f in kustomization()["resources"] if (K8S / f).is_file()]


def documents() -> list[dict[str, Any]]:
    return [d for f in manifests() for d in yaml.safe_load_all((K8S / f).read_text()) if d]


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    return [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in documents() if "template" in d["spec"]]


def by_name(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(kind: str, name: str) -> dict[str, Any]:
    (c,) = by_name(kind, name)["spec"]["template"]["spec"]["containers"]
    return c


def compose() -> dict[str, Any]:
    """The GPU deployment compose runs (docker-compose.yml with docker-compose.gpu.yml), as Kubernetes does."""
    from tests.unit.test_deploy import gpu_compose

    return gpu_compose()


def test_kustomization_lists_every_manifest() -> None:
    listed = set(manifests())
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization()["resources"]) - listed == {"../../configs"}


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_validates_against_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)  # raises, naming the field, when invalid


def test_a_broken_manifest_is_caught() -> None:
    import kubernetes_validate

    doc = by_name("Deployment", "grpo-actor")
    doc["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    doc = by_name("Deployment", "grpo-actor")
    doc["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"  # a typo: strict refuses it
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_roles_run_what_compose_runs() -> None:
    services = compose()["services"]
    for kind, name, role, port in (
        ("StatefulSet", "grpo-learner", "learner", 9400),
        ("Deployment", "grpo-actor", "actor", 9401),
    ):
        c = container(kind, name)
        # The same command, the config named by GRPO_CONFIG as compose names it.
        expected = [
            a.replace("${GRPO_CONFIG:-configs/compose-gpu.yaml}", "$(GRPO_CONFIG)") for a in services[role]["command"]
        ]
        assert c["command"] == expected
        assert c["ports"] == [{"name": "metrics", "containerPort": port}]
        annotations = by_name(kind, name)["spec"]["template"]["metadata"]["annotations"]
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                               "prometheus.io/path": "/metrics"}  # fmt: skip
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert c["livenessProbe"]["httpGet"]["path"] == c["startupProbe"]["httpGet"]["path"] == "/healthz"
        # Every variable compose gives the roles is set here too (the password from a Secret).
        env = {e["name"] for e in c["env"]} | set(config_map())
        assert set(services[role]["environment"]) <= env, set(services[role]["environment"]) - env
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert {"/weights", "/runs", "/hf-cache", "/dev/shm"} <= set(mounts)
        assert mounts["/weights"].get("readOnly", False) is (role == "actor")  # the learner alone writes weights
    # One learner per run, actors scale.
    assert by_name("StatefulSet", "grpo-learner")["spec"]["replicas"] == 1
    assert by_name("Deployment", "grpo-actor")["spec"]["replicas"] >= 1
    assert by_name("PersistentVolumeClaim", "grpo-weights")["spec"]["accessModes"] == ["ReadWriteMany"]


def config_map() -> dict[str, str]:
    (generator,) = kustomization()["configMapGenerator"]
    return dict(item.split("=", 1) for item in generator["literals"])


def test_the_config_the_pods_name_loads_with_their_environment() -> None:
    env = {k: v for k, v in config_map().items() if k.startswith("GRPO_")}
    assert (REPO / env.pop("GRPO_CONFIG")).is_file()
    cfg = load_config(REPO / "configs" / config_map()["GRPO_CONFIG"].removeprefix("configs/"), ["metrics.port=9400"],
                      env=env)  # fmt: skip
    assert cfg.redis.url == "redis://grpo-redis:6379/0" and cfg.run.name == "k8s" and cfg.metrics.host == "0.0.0.0"
    assert cfg.weights.dir == "/weights/k8s" and cfg.actor.engine == "sglang" and cfg.model.device == "cuda"
    assert by_name("Service", "grpo-redis")["spec"]["ports"][0]["port"] == 6379


def test_the_probes_leave_the_bound_to_healthz() -> None:
    """/healthz carries the bound (metrics.stall_after_s, or a step's own: the lease wait, a SGLang server's start),
    so the liveness probe restarts a pod within minutes of it failing and never fails sooner itself: its requests
    have time to be answered, and the startup probe holds it off until the process serves."""
    cfg = load_config(REPO / "configs" / config_map()["GRPO_CONFIG"].removeprefix("configs/"), ["metrics.port=9400"],
                      env={k: v for k, v in config_map().items() if k.startswith("GRPO_")})  # fmt: skip
    for kind, name in (("StatefulSet", "grpo-learner"), ("Deployment", "grpo-actor")):
        c = container(kind, name)
        live, start, ready = c["livenessProbe"], c["startupProbe"], c["readinessProbe"]
        assert "initialDelaySeconds" not in live  # the startup probe holds it off, however long the start takes
        restart_after_s = live["periodSeconds"] * live["failureThreshold"]
        assert restart_after_s <= 120 < cfg.metrics.stall_after_s, name  # the bound decides, the probe follows
        assert start["periodSeconds"] * start["failureThreshold"] >= 3600, name  # imports, model.path fetched
        for probe in (live, start, ready):  # the answer comes from the server's thread, on a busy machine
            assert probe["timeoutSeconds"] >= 5 and probe["httpGet"]["port"] == "metrics", name


def test_redis_keeps_its_data_and_demands_the_password() -> None:
    c = container("StatefulSet", "grpo-redis")
    # The same start script as compose's redis (tests/integration/test_deploy_redis.py runs both).
    (script,) = [a for a in compose()["services"]["redis"]["command"] if "requirepass" in a]
    assert c["command"] == ["sh", "-c", script.replace("${REDIS_APPENDFSYNC:-everysec}", "everysec")]
    assert "--appendonly yes" in script
    (secret,) = [v["secret"] for v in by_name("StatefulSet", "grpo-redis")["spec"]["template"]["spec"]["volumes"]
                 if "secret" in v]  # fmt: skip
    assert secret["secretName"] == "grpo-redis" and secret["items"] == [{"key": "password", "path": "redis_password"}]
    assert by_name("StatefulSet", "grpo-redis")["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def test_no_command_line_carries_the_redis_password() -> None:
    # `$(REDIS_PASSWORD)` in a command or args is expanded onto the process's command line, which `ps` shows.
    for doc in documents():
        for c in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            probe = c.get("readinessProbe", {}).get("exec", {}).get("command", [])
            text = " ".join([*c.get("command", []), *c.get("args", []), *probe])
            assert "PASSWORD" not in text and "--requirepass" not in text, c["name"]


CONFIGS = REPO / "configs"


def test_the_run_configs_are_a_config_map_the_pods_mount() -> None:
    # kustomize reads files only at or below a kustomization: configs/ has its own, which this one lists.
    (generator,) = yaml.safe_load((CONFIGS / "kustomization.yaml").read_text())["configMapGenerator"]
    assert generator["name"] == "grpo-config"
    assert set(generator["files"]) == {p.name for p in CONFIGS.glob("*.yaml")} - {"kustomization.yaml"}
    assert config_map()["GRPO_CONFIG"].startswith("configs/")  # --config /app/$(GRPO_CONFIG)
    for kind, name in (("StatefulSet", "grpo-learner"), ("Deployment", "grpo-actor")):
        spec = by_name(kind, name)["spec"]["template"]["spec"]
        (volume,) = [v["name"] for v in spec["volumes"] if v.get("configMap", {}).get("name") == "grpo-config"]
        (mount,) = [m for m in container(kind, name)["volumeMounts"] if m["name"] == volume]
        assert mount["mountPath"] == "/app/configs" and mount["readOnly"] is True


def dockerfile_uid(name: str) -> int:
    users = re.findall(r"^USER\s+(\d+)", (REPO / "docker" / name).read_text(), re.M)
    return int(users[-1])


def test_every_pod_runs_as_a_non_root_user_with_requests() -> None:
    specs = pod_specs()
    assert {name for name, _ in specs} == {"grpo-learner", "grpo-actor", "grpo-redis"}
    for name, spec in specs:
        pod = spec.get("securityContext", {})
        assert pod.get("runAsUser", 0) != 0 and pod.get("fsGroup") == pod.get("runAsGroup"), name
        for c in spec["containers"]:
            context = c["securityContext"]
            assert context["runAsNonRoot"] is True and context["allowPrivilegeEscalation"] is False, name
            assert context["capabilities"]["drop"] == ["ALL"], name
            requests = c["resources"]["requests"]
            assert requests.get("cpu") and requests.get("memory"), name
    # The roles' user is the one their images create (it owns the directories the volumes start from).
    for kind, name, dockerfile in (
        ("StatefulSet", "grpo-learner", "Dockerfile"),
        ("Deployment", "grpo-actor", "actor.Dockerfile"),
    ):
        assert by_name(kind, name)["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == dockerfile_uid(
            dockerfile
        )


def test_the_roles_say_why_they_exit() -> None:
    # Exit 2 (a config error) restarts into CrashLoopBackOff; the pod's status shows its one line.
    for kind, name in (("StatefulSet", "grpo-learner"), ("Deployment", "grpo-actor")):
        assert container(kind, name)["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_every_stateful_set_has_its_headless_service() -> None:
    sets = [d for d in documents() if d["kind"] == "StatefulSet"]
    assert {d["metadata"]["name"] for d in sets} == {"grpo-learner", "grpo-redis"}
    for s in sets:
        service = by_name("Service", s["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"].items() <= s["spec"]["template"]["metadata"]["labels"].items()


def effective_images() -> list[str]:
    """Every container's image after kustomization.yaml's `images` replaced names and tags."""
    replace = {i["name"]: i for i in kustomization().get("images", [])}
    out = []
    for _, spec in pod_specs():
        for c in spec["containers"]:
            name, _, tag = c["image"].partition(":")
            if name in replace:
                tag = str(replace[name].get("newTag", tag))
                name = replace[name].get("newName", name)
            out.append(f"{name}:{tag}" if tag else name)
    return out


def test_every_image_has_a_tag_and_none_is_latest() -> None:
    images = effective_images()
    assert len(images) == 3
    for image in images:
        tag = image.rpartition("/")[2].partition(":")[2]  # a registry's port is before the last /
        assert tag and tag != "latest", image


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (which builds kustomizations) is not installed")
def test_kustomize_builds_it() -> None:
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, check=True).stdout
    built = [d for d in yaml.safe_load_all(out) if d]
    (config,) = [d for d in built if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("grpo-config-")]
    assert set(config["data"]) == {p.name for p in CONFIGS.glob("*.yaml")} - {"kustomization.yaml"}
    assert {d["metadata"].get("namespace") for d in built} == {"grpo"}
    for d in built:
        spec = d.get("spec", {}).get("template", {}).get("spec")
        if spec is None:
            continue
        names = {v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v}
        assert names <= {config["metadata"]["name"]}, names  # the hashed name, so an edit rolls the pods
        for c in spec["containers"]:
            assert c["image"].partition(":")[2] not in ("", "latest"), c["image"]
