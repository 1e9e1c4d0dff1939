"""deploy/kubernetes: every manifest is a valid Kubernetes object (checked against the Kubernetes OpenAPI schemas
that the `kubernetes-validate` package ships, no cluster or kubectl needed), and the manifests run what
docker-compose.yml runs."""

from __future__ import annotations

import re
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


def documents() -> list[dict[str, Any]]:
    return [d for f in kustomization()["resources"] for d in yaml.safe_load_all((K8S / f).read_text()) if d]


def by_name(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(kind: str, name: str) -> dict[str, Any]:
    (c,) = by_name(kind, name)["spec"]["template"]["spec"]["containers"]
    return c


def compose() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_kustomization_lists_every_manifest() -> None:
    listed = set(kustomization()["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


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
            a.replace("${GRPO_CONFIG:-configs/compose.yaml}", "$(GRPO_CONFIG)") for a in services[role]["command"]
        ]
        expected = [re.sub(r"\$\{SGLANG_MEM_FRACTION:-([0-9.]+)\}", r"\1", a) for a in expected]
        assert c["command"] == expected
        assert c["ports"] == [{"name": "metrics", "containerPort": port}]
        annotations = by_name(kind, name)["spec"]["template"]["metadata"]["annotations"]
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                               "prometheus.io/path": "/metrics"}  # fmt: skip
        assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
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
    cfg = load_config(REPO / "configs" / "compose.yaml", ["metrics.port=9400"], env=env)
    assert cfg.redis.url == "redis://grpo-redis:6379/0" and cfg.run.name == "k8s" and cfg.metrics.host == "0.0.0.0"
    assert by_name("Service", "grpo-redis")["spec"]["ports"][0]["port"] == 6379


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
