"""deploy/grafana/dashboards/grpo.json imports into any Grafana: its data source is a variable (no data source uid of
one installation), and a run variable selects one run's series in every query."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "grpo.json"


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard()["templating"]["list"]}


def test_the_data_source_and_the_run_are_variables() -> None:
    ds = variables()["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    run = variables()["run"]
    assert run["type"] == "query" and run["datasource"]["uid"] == "${datasource}"
    # The run's name is a label of grpo_build_info, which every process exports (common.metrics.process_registry).
    assert run["query"]["query"] == run["definition"] == "label_values(grpo_build_info, run)"


def test_no_panel_or_query_names_a_data_source_of_its_own() -> None:
    for panel in dashboard()["panels"]:
        for where in [panel, *panel["targets"]]:
            assert where["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def test_every_query_is_filtered_by_the_run() -> None:
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            # Metrics carry no run label: each selects its processes by joining their grpo_build_info of the run.
            joins = re.findall(r'on \(job, instance\) group_left \(\) grpo_build_info\{run="\$run"\}', expr)
            metrics = set(re.findall(r"\b(?:grpo|process)_[a-z_]+", expr)) - {"grpo_build_info"}
            assert joins and len(joins) == len(metrics), f"{panel['title']}: {expr}"
