"""The shipped Grafana dashboards: the committed JSON matches the code that builds
it, every panel is complete, and every query runs on a real Prometheus scraping
the agent."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from dlprof_agent.grafana import build as dashboards
from tests.conftest import Prometheus, http_get, wait_for

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "grafana" / "dashboards"
REGENERATE = "regenerate with `python -m dlprof_agent.grafana.build` and commit the result"
UNITS = {"s", "bytes", "Bps", "percentunit", "watt", "hertz", "celsius", "short", "ops"}
METRIC = re.compile(r"dlprof_[a-z0-9_]+")
GPU_METRIC = re.compile(r"\bdlprof_(?:process_)?gpu_")
# What Grafana puts in for the variables when every job and process is selected.
SUBSTITUTIONS = {"$__rate_interval": "4s", "$__interval": "1s", "$job": ".*", "$pid": ".*"}
LABEL_VALUES = re.compile(r"label_values\((?P<selector>.+), *(?P<label>[a-z_]+)\)")


def documented_metrics() -> set[str]:
    text = (REPO / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `(dlprof_[a-z0-9_]+)` \|", text, re.MULTILINE))


def substitute(promql: str) -> str:
    for variable, value in SUBSTITUTIONS.items():
        promql = promql.replace(variable, value)
    assert "$" not in promql, promql
    return promql


def is_gpu(panel: dict[str, Any]) -> bool:
    return any(GPU_METRIC.search(target["expr"]) for target in panel["targets"])


@pytest.fixture(scope="module")
def overview() -> dict[str, Any]:
    return dashboards.build_overview()


def test_committed_json_is_what_the_code_builds(tmp_path: Path) -> None:
    committed = {path.name for path in COMMITTED.glob("*.json")}
    assert committed == set(dashboards.dashboards()), REGENERATE
    for path in dashboards.write(tmp_path):
        assert path.read_text() == (COMMITTED / path.name).read_text(), \
            f"{path.name} differs from the code: {REGENERATE}"


def test_module_runs_as_a_script(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dlprof_agent.grafana.build", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"wrote {tmp_path / 'overview.json'}\n"
    model = json.loads((tmp_path / "overview.json").read_text())
    assert model["uid"] == "dlprof-overview"
    assert model["title"] == "dlprof-agent: where the time goes"


def test_variables_pick_the_datasource_then_job_then_pids(overview: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in overview["templating"]["list"]}
    assert list(variables) == ["datasource", "job", "pid"]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["query"] == "label_values(dlprof_target_up, job)"
    assert variables["pid"]["query"] == 'label_values(dlprof_process_info{job=~"$job"}, pid)'
    assert variables["pid"]["multi"] and variables["pid"]["includeAll"]
    for name in ("job", "pid"):
        assert variables[name]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_every_panel_is_complete(overview: dict[str, Any]) -> None:
    everything = overview["panels"]
    ids = [panel["id"] for panel in everything]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    panels = list(dashboards.panels(overview))
    assert len(panels) > 20
    for panel in panels:
        title = panel["title"]
        assert panel["type"] in {"timeseries", "stat"}, title
        assert panel["fieldConfig"]["defaults"].get("unit") in UNITS, title
        assert len(panel.get("description", "")) > 20, f"{title}: say what to look for"
        assert panel["targets"], title
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
            assert target["expr"].strip(), title
    assert [p["title"] for p in everything if p["type"] == "row"] == [
        "Overview", "CPU", "Memory", "I/O", "GPU", "Agent"]


def test_panels_do_not_overlap(overview: dict[str, Any]) -> None:
    taken: set[tuple[int, int]] = set()
    for panel in overview["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                 for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_queries_use_only_documented_metrics(overview: dict[str, Any]) -> None:
    documented = documented_metrics()
    assert len(documented) > 40, "the tables of docs/metrics.md changed shape"
    exprs = dashboards.queries(overview)
    assert len(exprs) >= len(list(dashboards.panels(overview)))
    used = {name for expr in exprs for name in METRIC.findall(expr)}
    assert used - documented == set(), "not in docs/metrics.md"


@pytest.mark.e2e
def test_every_query_runs_on_prometheus(
        busy: subprocess.Popen[bytes], agent: tuple[subprocess.Popen[bytes], int],
        prometheus: Prometheus, overview: dict[str, Any]) -> None:
    wait_for(lambda: prometheus.query("rate(dlprof_process_cpu_seconds_total[4s])"),
             "a few scrapes to land in Prometheus", 20)

    for expr in dashboards.queries(overview):
        prometheus.query(substitute(expr))  # asserts Prometheus accepted it

    empty = [panel["title"] for panel in dashboards.panels(overview)
             if not is_gpu(panel)
             and not prometheus.query(substitute(panel["targets"][0]["expr"]))]
    assert empty == [], "no series for these panels (the machine has no GPU; others must show)"

    # The variables' label_values() queries, as Grafana sends them.
    values = {}
    for variable in overview["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = LABEL_VALUES.fullmatch(variable["query"])
        assert match, variable["query"]
        url = (f"{prometheus.url}/api/v1/label/{match['label']}/values?"
               + urllib.parse.urlencode({"match[]": substitute(match["selector"])}))
        answer = json.loads(http_get(url))
        assert answer["status"] == "success", answer
        values[variable["name"]] = answer["data"]
    assert values == {"job": ["dlprof"], "pid": [str(busy.pid)]}
