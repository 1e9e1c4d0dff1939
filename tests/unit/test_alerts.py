"""deploy/prometheus/alerts.yml: valid rules (`promtool check rules`), loaded by compose's prometheus.yml (`promtool
check config`), each alert with a `for:`, a severity and advice; and alert by alert, series in → alert out
(`promtool test rules`): each fires on the condition it names and stays quiet on its look-alike."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
PROMETHEUS_YML = REPO / "deploy" / "prometheus" / "prometheus.yml"

LEARNER = {"job": "grpo-learner", "instance": "learner:9400"}
ACTORS = [{"job": "grpo-actor", "instance": f"actor-{i}:9401"} for i in (1, 2)]
RUN = "run-a"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`; .ci/run installs it)")
    return path


def rules() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}


def series(name: str, target: dict[str, str], values: str) -> dict[str, str]:
    labels = ",".join(f'{k}="{v}"' for k, v in target.items())
    return {"series": f"{name}{{{labels}}}", "values": values}


def build_info(target: dict[str, str], minutes: int) -> dict[str, str]:
    return series("grpo_build_info", {**target, "run": RUN, "version": "0.1.0"}, f"1x{minutes}")


def render(text: str, labels: dict[str, str], value: str) -> str:
    """The annotation Prometheus sends, for the templates the rules use."""
    text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)
    return text.replace("{{ $value | humanizePercentage }}", value).replace("{{ $value }}", value)


def fired(alert: str, labels: dict[str, str], value: str) -> dict[str, Any]:
    """The alert promtool must see: the rule's labels and annotations, rendered for ``labels`` and ``value``."""
    rule = rules()[alert]
    every = {**labels, **rule["labels"]}
    return {
        "exp_labels": every,
        "exp_annotations": {k: render(v, every, value) for k, v in rule["annotations"].items()},
    }


def at(minute: int, alert: str, *alerts: dict[str, Any]) -> dict[str, Any]:
    """At ``minute``, ``alert`` fires exactly ``alerts`` (none: it is quiet)."""
    return {"eval_time": f"{minute}m", "alertname": alert, "exp_alerts": list(alerts)}


def run_promtool_test(tmp_path: Path, tests: list[dict[str, Any]]) -> None:
    spec = {"rule_files": [str(ALERTS)], "evaluation_interval": "1m", "tests": tests}
    path = tmp_path / "alerts_test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    done = subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_accepts_the_rules() -> None:
    done = subprocess.run([promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(rules())} rules found" in done.stdout


def test_compose_prometheus_loads_the_rules_file_beside_it(tmp_path: Path) -> None:
    """Compose mounts both files in /etc/prometheus/: the relative rule_files entry finds alerts.yml there."""
    assert yaml.safe_load(PROMETHEUS_YML.read_text())["rule_files"] == ["alerts.yml"]
    shutil.copy(PROMETHEUS_YML, tmp_path / "prometheus.yml")
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    done = subprocess.run([promtool(), "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 rule files found" in done.stdout and f"{len(rules())} rules found" in done.stdout


def test_every_alert_waits_names_a_severity_and_says_what_to_do() -> None:
    assert {
        "GRPOLearnerStalled",
        "GRPOLearnerDown",
        "GRPOStreamFull",
        "GRPOAllGroupsFiltered",
        "GRPOAccountingNotBalanced",
    } <= set(rules())
    for name, rule in rules().items():
        assert rule.get("for"), f"{name}: no for:"
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 80, name
        assert "grpo_build_info" in rule["expr"], f"{name}: its alerts would not name their run"


def test_learner_stalled_fires_on_a_step_that_stands_still_not_on_a_finished_run(tmp_path: Path) -> None:
    stuck = [
        series("grpo_learner_step", LEARNER, "0+1x10 10x50"),  # 10 steps, then nothing from minute 10
        series("grpo_learner_run_steps", LEARNER, "100x60"),
        build_info(LEARNER, 60),
    ]
    finished = [
        series("grpo_learner_step", LEARNER, "0+1x10 10x50"),  # the same curve, but 10 was the last step
        series("grpo_learner_run_steps", LEARNER, "10x60"),
        build_info(LEARNER, 60),
    ]
    labels = {**LEARNER, "run": RUN}
    run_promtool_test(tmp_path, [
        {"interval": "1m", "input_series": stuck, "alert_rule_test": [
            at(35, "GRPOLearnerStalled"),  # 25 minutes without a step: not yet
            at(45, "GRPOLearnerStalled", fired("GRPOLearnerStalled", labels, "10")),
        ]},
        {"interval": "1m", "input_series": finished, "alert_rule_test": [
            at(55, "GRPOLearnerStalled"),
        ]},
    ])  # fmt: skip


def test_learner_down_fires_when_actors_run_without_a_learner(tmp_path: Path) -> None:
    def inputs(learner_minutes: int) -> list[dict[str, str]]:
        actors = [s for a in ACTORS for s in (series("grpo_actor_policy_version", a, "3x30"), build_info(a, 30))]
        learner = series("grpo_learner_step", LEARNER, f"3x{learner_minutes}")
        return [*actors, learner, build_info(LEARNER, learner_minutes)]

    labels = {"run": RUN}
    run_promtool_test(tmp_path, [
        {"interval": "1m", "input_series": inputs(8), "alert_rule_test": [  # the learner's series end at minute 8
            at(7, "GRPOLearnerDown"),
            at(12, "GRPOLearnerDown"),  # gone (Prometheus forgets a series 5 minutes after its last sample), for: 5m
            at(25, "GRPOLearnerDown", fired("GRPOLearnerDown", labels, "2")),
        ]},
        {"interval": "1m", "input_series": inputs(30), "alert_rule_test": [at(25, "GRPOLearnerDown")]},
    ])  # fmt: skip


def test_accounting_not_balanced_fires_on_unexplained_groups_only(tmp_path: Path) -> None:
    lost = [series("grpo_learner_accounting_unexplained_groups", LEARNER, "0x5 3x20"), build_info(LEARNER, 25)]
    labels = {**LEARNER, "run": RUN}
    run_promtool_test(tmp_path, [
        {"interval": "1m", "input_series": lost, "alert_rule_test": [
            at(5, "GRPOAccountingNotBalanced"),
            at(6, "GRPOAccountingNotBalanced"),  # for: 2m
            at(10, "GRPOAccountingNotBalanced", fired("GRPOAccountingNotBalanced", labels, "3")),
        ]},
    ])  # fmt: skip


def test_all_groups_filtered_fires_when_actors_filter_and_send_nothing(tmp_path: Path) -> None:
    def actors(produced: str) -> list[dict[str, str]]:
        out = []
        for target in ACTORS:
            out += [series("grpo_actor_groups_filtered_total", {**target, "reason": "zero_std"}, "0+4x60"),
                    series("grpo_actor_groups_produced_total", target, produced), build_info(target, 60)]  # fmt: skip
        return out

    run_promtool_test(tmp_path, [
        {"interval": "1m", "input_series": actors("5x60"), "alert_rule_test": [  # nothing sent since the start
            at(30, "GRPOAllGroupsFiltered", fired("GRPOAllGroupsFiltered", {"run": RUN}, "")),
        ]},
        {"interval": "1m", "input_series": actors("0+1x60"), "alert_rule_test": [  # a few still get through
            at(30, "GRPOAllGroupsFiltered"),
        ]},
    ])  # fmt: skip


def test_stream_full_fires_when_every_actor_waits(tmp_path: Path) -> None:
    def actors(second: str) -> list[dict[str, str]]:
        waits = ["0+60x60", second]  # seconds of backpressure, counted each minute
        return [s for t, w in zip(ACTORS, waits, strict=True)
                for s in (series("grpo_actor_backpressure_wait_seconds_total", t, w), build_info(t, 60))]  # fmt: skip

    run_promtool_test(tmp_path, [
        {"interval": "1m", "input_series": actors("0+57x60"), "alert_rule_test": [
            at(40, "GRPOStreamFull", fired("GRPOStreamFull", {"run": RUN}, "95%")),
        ]},
        {"interval": "1m", "input_series": actors("0+30x60"), "alert_rule_test": [  # one actor samples half the time
            at(40, "GRPOStreamFull"),
        ]},
    ])  # fmt: skip


def test_the_learners_own_alarms_become_alerts(tmp_path: Path) -> None:
    alarms = [
        series("grpo_learner_alarm", {**LEARNER, "kind": "clip_ratio"}, "0x3 1x10"),
        series("grpo_learner_alarm", {**LEARNER, "kind": "zero_std"}, "0x13"),
        build_info(LEARNER, 13),
    ]
    labels = {**LEARNER, "kind": "clip_ratio", "run": RUN}
    run_promtool_test(tmp_path, [
        {"interval": "1m", "input_series": alarms, "alert_rule_test": [
            at(8, "GRPOClipRatioHigh", fired("GRPOClipRatioHigh", labels, "1")),
            at(8, "GRPOZeroStdHigh"),
        ]},
    ])  # fmt: skip
