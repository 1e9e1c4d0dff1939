"""A real Prometheus server scrapes a running `grpo run`, configured with compose's prometheus.yml where only the
service discovery is swapped (DNS → a file written from endpoints.json); the test reads step, reward and per-actor
groups/s back through Prometheus' HTTP query API. Also: `promtool check config` passes on compose's file, every
metric the Grafana dashboard queries appears in a scrape of the running processes, each dashboard query (its run
variable set to the run) evaluates, and Prometheus loads and evaluates the alert rules (alerts.yml) without error."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from common.children import wait_until
from common.ports import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_YML = REPO / "deploy" / "prometheus" / "prometheus.yml"
ALERTS_YML = REPO / "deploy" / "prometheus" / "alerts.yml"
JOBS = {"learner": "grpo-learner", "actor": "grpo-actor"}


def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} is not installed (Debian package `prometheus`; .ci/run installs it)")
    return path


def test_promtool_accepts_compose_prometheus_config() -> None:
    done = subprocess.run([need("promtool"), "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    reply = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert reply["status"] == "success", reply
    return list(reply["data"]["result"])


def exported_names(body: str) -> set[str]:
    """Metric names a scrape declares (# TYPE lines: labelled metrics are declared before their first sample)."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", body, re.M):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(kind, [""])
        names |= {name} | {name.removesuffix("_total") + s for s in suffixes}  # a counter is typed with or without it
    return names


def test_prometheus_scrapes_a_running_grpo_run(demo_model_dir: Path, tmp_path: Path, processes) -> None:  # type: ignore[no-untyped-def]
    prometheus = need("prometheus")
    run_dir = tmp_path / "run"
    run = processes.grpo("run", "--plain", "-o", "run.steps=400", "-o", f"run.dir={run_dir}", log=tmp_path / "run.log")
    endpoints_file = run_dir / "endpoints.json"
    assert wait_until(endpoints_file.exists, 120), (tmp_path / "run.log").read_text()
    endpoints = json.loads(endpoints_file.read_text())

    # Compose's configuration, with each job's DNS discovery replaced by a file of the same processes.
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    for job in config["scrape_configs"]:
        role = next(r for r, j in JOBS.items() if j == job["job_name"])
        targets = [urllib.parse.urlsplit(e["metrics_url"]).netloc for e in endpoints if e["role"] == role]
        sd_file = tmp_path / f"{job['job_name']}.json"
        sd_file.write_text(json.dumps([{"targets": targets}]))
        del job["dns_sd_configs"]
        job["file_sd_configs"] = [{"files": [str(sd_file)]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(ALERTS_YML, tmp_path / "alerts.yml")  # beside it, as compose mounts both (rule_files is relative)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    processes.start(
        [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        tmp_path / "prometheus.log",
    )  # fmt: skip

    def ready() -> bool:
        try:
            return urllib.request.urlopen(f"{base}/-/ready", timeout=2).status == 200
        except OSError:
            return False

    assert wait_until(ready, 60), (tmp_path / "prometheus.log").read_text()

    def answered() -> bool:
        steps = query(base, "grpo_learner_step")
        per_actor = query(base, "rate(grpo_actor_groups_produced_total[20s])")
        return (
            bool(steps)
            and float(steps[0]["value"][1]) > 0
            and len(per_actor) == 2
            and all(float(r["value"][1]) > 0 for r in per_actor)
        )

    assert wait_until(answered, 120, interval_s=1.0), (tmp_path / "prometheus.log").read_text()
    reward = query(base, "grpo_learner_reward_mean")
    assert reward and 0.0 <= float(reward[0]["value"][1]) <= 1.0
    up = query(base, "up")
    assert sorted(r["metric"]["job"] for r in up) == ["grpo-actor", "grpo-actor", "grpo-learner"]
    assert all(r["value"][1] == "1" for r in up)

    # Every metric the dashboard queries is declared by a process's scrape.
    exported: set[str] = set()
    for e in endpoints:
        exported |= exported_names(urllib.request.urlopen(e["metrics_url"], timeout=5).read().decode())
    dashboard = json.loads((REPO / "deploy" / "grafana" / "dashboards" / "grpo.json").read_text())
    used = {m for p in dashboard["panels"] for t in p["targets"] for m in re.findall(r"\bgrpo_[a-z_]+", t["expr"])}
    assert used <= exported, used - exported

    # The dashboard's run variable lists this run, and every query, filtered by it, evaluates.
    runs = {r["metric"]["run"] for r in query(base, "grpo_build_info")}
    assert runs == {"default"}, runs
    exprs = {t["expr"].replace("$run", "default") for p in dashboard["panels"] for t in p["targets"]}
    for expr in exprs:
        query(base, expr)  # a query Prometheus refuses fails here
    step_expr = next(e for e in exprs if e.startswith("grpo_learner_step "))
    assert query(base, step_expr), step_expr  # the join selects the run's learner

    # The alert rules are loaded, and each has been evaluated without error.
    alerts = yaml.safe_load(ALERTS_YML.read_text())["groups"][0]["rules"]

    def rules_evaluated() -> bool:
        reply = json.loads(urllib.request.urlopen(f"{base}/api/v1/rules", timeout=10).read())
        loaded = [r for g in reply["data"]["groups"] for r in g["rules"]]
        return len(loaded) == len(alerts) and all(r["health"] == "ok" for r in loaded)

    assert wait_until(rules_evaluated, 60, interval_s=1.0), urllib.request.urlopen(f"{base}/api/v1/rules").read()

    run.terminate()  # Ctrl-C-like stop: the run stops every process it started
    assert run.wait(timeout=60) in (0, 130, 143)  # stopped by us: 128 + SIGTERM
