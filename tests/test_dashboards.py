"""The shipped Grafana dashboards and Prometheus config: the committed JSON matches
the code that builds it, every panel is complete, the config and rules pass
promtool, and every query runs on a real Prometheus that uses the shipped config
and rules to scrape the agent attached to a real training job."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dlprof_agent.exporters.prometheus_rules import (
    CPU_RATE,
    KERNEL_RATE,
    LAYER_RATE,
    STEP_MEAN,
    THREAD_CPU_RATE,
)
from dlprof_agent.grafana import build as dashboards
from dlprof_agent.grafana.job import IDENTITY_METRICS
from dlprof_agent.grafana.overview import build_overview
from dlprof_agent.grafana.panels import KERNEL_METRICS
from tests.conftest import (
    PROMETHEUS,
    PROMTOOL,
    Prometheus,
    agent_env,
    free_port,
    http_get,
    running_prometheus,
    wait_for,
)

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "dlprof_agent" / "grafana" / "dashboards"
DEPLOY = REPO / "deploy" / "prometheus"
JOB = REPO / "tests" / "jobs" / "torch_cnn.py"
REGENERATE = "regenerate with `python -m dlprof_agent.grafana.build` and commit the result"
FILES = ("overview.json", "layers.json", "threads.json", "gpu.json", "job.json")
# Its queries need the job_id and rank labels: tests/test_job_dashboard.py runs them.
JOB_FILE = "job.json"
UNITS = {"s", "bytes", "Bps", "percentunit", "watt", "hertz", "celsius", "short", "ops",
         "string"}
# A metric or recording-rule name (rules carry colons around the metric's name).
NAME = re.compile(r"[a-z_:]*dlprof_[a-z0-9_:]*")
HISTOGRAM_SERIES = re.compile(r"_(?:bucket|sum|count)$")
# NVML metrics have series only where there is a GPU; dlprof_gpu_available is always there.
GPU_METRIC = re.compile(r"^dlprof_(?:process_)?gpu_(?!available$)")
LABEL_VALUES = re.compile(r"label_values\((?P<selector>.+), *(?P<label>[a-z_]+)\)")


def documented_metrics() -> set[str]:
    text = (REPO / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `(dlprof_[a-z0-9_]+)` \|", text, re.MULTILINE))


def shipped_rules() -> list[dict[str, Any]]:
    """Every rule of the shipped rules.yml, recording and alerting, in file order."""
    groups = yaml.safe_load((DEPLOY / "rules.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def recording_rules() -> dict[str, str]:
    """Name -> expr of every recording rule in the shipped rules.yml."""
    return {rule["record"]: rule["expr"] for rule in shipped_rules() if "record" in rule}


def alerting_rules() -> dict[str, str]:
    """Name -> expr of every alert (the straggler's causes share one name)."""
    return {rule["alert"]: rule["expr"] for rule in shipped_rules() if "alert" in rule}


def scrape_interval_seconds() -> int:
    config = (DEPLOY / "prometheus.yml").read_text()
    match = re.search(r"^ +scrape_interval: (\d+)s$", config, re.MULTILINE)
    assert match, "prometheus.yml sets scrape_interval in whole seconds"
    return int(match[1])


def substitutions() -> dict[str, str]:
    """What Grafana puts in for the variables: job dlprof, everything else All.
    $__rate_interval is four scrape intervals when the data source's scrape
    interval matches prometheus.yml."""
    interval = scrape_interval_seconds()
    return {"$__rate_interval": f"{4 * interval}s", "$__interval": f"{interval}s",
            "$job": "dlprof", "$instance": ".*", "$pid": ".*", "$gpu": ".*",
            "$job_id": "train"}


def substitute(promql: str) -> str:
    # Longest first: $job is the start of $job_id.
    for variable, value in sorted(substitutions().items(), key=lambda item: -len(item[0])):
        promql = promql.replace(variable, value)
    assert "$" not in promql, promql
    return promql


def metrics_behind(expr: str) -> set[str]:
    """The served metrics an expression reads, through recording rules, with a
    histogram's _bucket/_sum/_count series named by the histogram."""
    rules = recording_rules()
    found = set()
    for name in NAME.findall(expr):
        if name in rules:
            found |= metrics_behind(rules[name])
        elif ":" not in name:
            found.add(HISTOGRAM_SERIES.sub("", name))
    return found


def needs_gpu(panel: dict[str, Any]) -> bool:
    """Whether the panel's data comes from NVML or the CUPTI tracer only."""
    return any(GPU_METRIC.match(metric) or metric in KERNEL_METRICS
               for target in panel["targets"] for metric in metrics_behind(target["expr"]))


def owed_to_gpu(models: dict[str, dict[str, Any]]) -> list[str]:
    """The panels a CPU-only machine cannot fill: check them on one with a GPU."""
    return [f"{name}: {panel['title']}" for name, model in models.items()
            for panel in dashboards.panels(model) if needs_gpu(panel)]


@pytest.fixture(scope="module")
def models() -> dict[str, dict[str, Any]]:
    return dashboards.dashboards()


@pytest.fixture(scope="module", params=FILES)
def model(request: pytest.FixtureRequest, models: dict[str, dict[str, Any]]
          ) -> dict[str, Any]:
    return models[request.param]


def test_committed_json_is_what_the_code_builds(tmp_path: Path) -> None:
    committed = {path.name for path in COMMITTED.glob("*.json")}
    assert committed == set(dashboards.dashboards()) == set(FILES), REGENERATE
    for path in dashboards.write(tmp_path):
        assert path.read_text() == (COMMITTED / path.name).read_text(), \
            f"{path.name} differs from the code: {REGENERATE}"


def test_module_runs_as_a_script(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dlprof_agent.grafana.build", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "".join(f"wrote {tmp_path / name}\n" for name in FILES)
    model = json.loads((tmp_path / "overview.json").read_text())
    assert model["uid"] == "dlprof-overview"
    assert model["title"] == "dlprof-agent: where the time goes"
    uids = {json.loads((tmp_path / name).read_text())["uid"] for name in FILES}
    assert len(uids) == len(FILES), "each dashboard needs its own uid"


def test_variables_pick_the_datasource_then_job_instance_pids_and_gpus(
        model: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in model["templating"]["list"]}
    if model["uid"] == "dlprof-job":
        # One job across its agents: picked by job_id alone.
        assert list(variables) == ["datasource", "job_id"]
        assert variables["job_id"]["query"] == \
            'label_values(dlprof_target_info{job_id!=""}, job_id)'
        assert not variables["job_id"].get("multi")
        return
    uses_gpus = any('gpu=~"$gpu"' in expr for expr in dashboards.queries(model))
    assert list(variables) == ["datasource", "job", "instance", "pid",
                               *(["gpu"] if uses_gpus else [])]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["query"] == "label_values(dlprof_target_up, job)"
    assert variables["instance"]["query"] == \
        'label_values(dlprof_target_up{job=~"$job"}, instance)'
    selector = 'job=~"$job",instance=~"$instance"'
    assert variables["pid"]["query"] == f"label_values(dlprof_process_info{{{selector}}}, pid)"
    if uses_gpus:
        assert variables["gpu"]["query"] == f"label_values(dlprof_gpu_info{{{selector}}}, gpu)"
    for name, variable in variables.items():
        if name == "datasource":
            continue
        assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        if name != "job":
            assert variable["multi"] and variable["includeAll"], name
            assert variable["allValue"] == ".*", name


def test_every_panel_is_complete(model: dict[str, Any]) -> None:
    everything = model["panels"]
    ids = [panel["id"] for panel in everything]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    panels = list(dashboards.panels(model))
    assert len(panels) >= 10
    for panel in panels:
        title = panel["title"]
        defaults = panel["fieldConfig"]["defaults"]
        assert panel["type"] in {"timeseries", "stat", "table"}, title
        assert defaults.get("unit") in UNITS, title
        assert len(panel.get("description", "")) > 60, f"{title}: say what to look for"
        steps = defaults["thresholds"]["steps"]
        assert steps and steps[0]["value"] is None, f"{title}: thresholds start at -inf"
        values = [step["value"] for step in steps[1:]]
        assert values == sorted(values), title
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        assert panel["targets"], title
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
            assert target["expr"].strip(), title


def test_overview_rows() -> None:
    overview = build_overview()
    assert [p["title"] for p in overview["panels"] if p["type"] == "row"] == [
        "Overview", "Training", "CPU", "Memory", "I/O", "GPU", "Agent"]
    assert len(list(dashboards.panels(overview))) > 20
    (settings,) = [p for p in dashboards.panels(overview) if p["type"] == "table"]
    (target,) = settings["targets"]
    assert target["expr"].startswith("dlprof_framework_info{")
    assert target["format"] == "table" and target["instant"]


def test_thresholds_mark_oversubscription_and_an_idle_gpu(
        models: dict[str, dict[str, Any]]) -> None:
    def steps(panel: dict[str, Any]) -> list[tuple[float | None, str]]:
        return [(s["value"], s["color"])
                for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]]

    every = [panel for model in models.values() for panel in dashboards.panels(model)]
    system = [p for p in every if p["title"].startswith("System share")]
    gpu_busy = [p for p in every if p["title"] in {"GPU utilization", "Mean utilization"}]
    assert len(system) >= 3 and len(gpu_busy) >= 3
    for panel in system:
        assert steps(panel) == [(None, "green"), (0.2, "orange"), (0.4, "red")], panel["title"]
    for panel in gpu_busy:
        assert steps(panel)[0] == (None, "red"), panel["title"]


def test_panels_do_not_overlap(model: dict[str, Any]) -> None:
    taken: set[tuple[int, int]] = set()
    for panel in model["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"])
                 for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_queries_use_only_documented_metrics_kernel_metrics_and_shipped_rules(
        model: dict[str, Any]) -> None:
    documented = documented_metrics()
    assert len(documented) > 40, "the tables of docs/metrics.md changed shape"
    rules = recording_rules()
    exprs = dashboards.queries(model)
    assert len(exprs) >= len(list(dashboards.panels(model)))
    names = {name for expr in exprs for name in NAME.findall(expr)}
    assert {n for n in names if ":" in n} - set(rules) == set(), "not in rules.yml"
    used = {metric for expr in exprs for metric in metrics_behind(expr)}
    assert used - documented - set(KERNEL_METRICS) - set(IDENTITY_METRICS) == set(), \
        "neither in docs/metrics.md nor in KERNEL_METRICS nor IDENTITY_METRICS"
    for expr in exprs:
        substitute(expr)  # only variables the dashboards define


def test_recording_rules_are_named_by_convention_and_all_used(
        models: dict[str, dict[str, Any]]) -> None:
    rules = recording_rules()
    assert len(rules) == (DEPLOY / "rules.yml").read_text().count("- record:")
    assert 1 <= len(rules) <= 30, "keep the rules few"
    per_process = {name: expr for name, expr in rules.items() if name.startswith("instance")}
    for name, expr in per_process.items():
        _, metric, operation = name.split(":")
        assert metric.startswith("dlprof_") and not metric.endswith("_total"), name
        assert re.fullmatch(r"(rate|mean)1m", operation), name
        assert f"[{operation.removeprefix('rate').removeprefix('mean')}]" in expr, name
    # The job's rules (tests/test_rules_command.py checks their names) aggregate to job_id.
    assert all(name.startswith("job_id") for name in set(rules) - set(per_process))
    used = {name for model in models.values() for expr in dashboards.queries(model)
            for name in NAME.findall(expr)}
    read = {name for expr in [*rules.values(), *alerting_rules().values()]
            for name in NAME.findall(expr)}
    assert set(rules) - used - read == set(), "a rule no dashboard, rule or alert reads"
    assert set(per_process) - used == set(), "a per-process rule no dashboard reads"
    constants = {CPU_RATE, THREAD_CPU_RATE, STEP_MEAN,
                 LAYER_RATE, KERNEL_RATE}
    assert constants == set(per_process)


def test_gpu_and_kernel_panels_are_known(models: dict[str, dict[str, Any]]) -> None:
    owed = owed_to_gpu(models)
    total = sum(len(list(dashboards.panels(m))) for m in models.values())
    assert "layers.json: Top kernels by time" in owed  # through KERNEL_RATE
    assert "layers.json: Kernel duration" in owed  # the histogram's _bucket series
    assert "gpu.json: Power" in owed
    assert "gpu.json: NVML" not in owed  # dlprof_gpu_available is served without a GPU
    assert "layers.json: Forward CPU time by layer" not in owed
    assert 0 < len(owed) < total


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (Debian package `prometheus`)")
    return subprocess.run([PROMTOOL, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=False)


def test_promtool_accepts_the_shipped_config() -> None:
    result = promtool("check", "config", str(DEPLOY / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_accepts_the_shipped_rules() -> None:
    result = promtool("check", "rules", str(DEPLOY / "rules.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(shipped_rules())} rules found" in result.stdout


def test_shipped_config_scrapes_dlprof_from_file_targets_with_the_rules() -> None:
    config = (DEPLOY / "prometheus.yml").read_text()
    assert 1 <= scrape_interval_seconds() <= 5
    assert re.search(r"^ +evaluation_interval: [1-5]s$", config, re.MULTILINE)
    assert re.search(r"^ +- job_name: dlprof$", config, re.MULTILINE)
    assert re.search(r"file_sd_configs:\n +- files:\n +- targets/\*\.json$", config,
                     re.MULTILINE)
    assert re.search(r"^rule_files:\n +- rules\.yml$", config, re.MULTILINE)
    (example,) = json.loads((DEPLOY / "targets" / "example.json").read_text())
    assert example["targets"] == ["localhost:9945"]


@pytest.fixture
def training(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """A PyTorch job under `dlprof-agent run --layers`: (the agent's port, the job's pid)."""
    pytest.importorskip("torch")
    port, log, stop = free_port(), tmp_path / "job.jsonl", tmp_path / "stop"
    with open(tmp_path / "agent.log", "wb") as agent_log:
        run = subprocess.Popen(
            [sys.executable, "-m", "dlprof_agent", "run", "--port", str(port), "--quiet",
             "--interval", "0.5", "--grace", "0", "--layers", "--warmup-steps", "3", "--",
             sys.executable, str(JOB), "--log", str(log), "--steps", "1000000",
             "--until", str(stop)],
            env=agent_env(), stdout=subprocess.DEVNULL, stderr=agent_log)
    try:
        def first_line() -> str:
            text = log.read_text() if log.exists() else ""
            return text.partition("\n")[0] if "\n" in text else ""

        yield port, int(json.loads(wait_for(first_line, "the job to start", 60))["pid"])
    finally:
        stop.touch()  # the job ends after its current step, then the agent
        try:
            run.wait(30)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait(10)


@pytest.fixture
def shipped_prometheus(tmp_path: Path, training: tuple[int, int]) -> Iterator[Prometheus]:
    """Prometheus with deploy/prometheus as it ships, its targets file naming the agent."""
    if PROMETHEUS is None:
        pytest.fail("the prometheus server is not installed (Debian package `prometheus`)")
    config = tmp_path / "prometheus"
    shutil.copytree(DEPLOY, config)
    for example in (config / "targets").glob("*.json"):
        example.unlink()  # localhost:9945 would be a second, down target
    (config / "targets" / "agent.json").write_text(
        json.dumps([{"targets": [f"127.0.0.1:{training[0]}"]}]))
    # Started from elsewhere: the config's relative paths must resolve against its folder.
    with running_prometheus(config / "prometheus.yml", tmp_path / "data", cwd=tmp_path) as server:
        yield server


@pytest.mark.e2e
def test_every_query_of_every_dashboard_runs_on_the_shipped_prometheus(
        training: tuple[int, int], shipped_prometheus: Prometheus,
        models: dict[str, dict[str, Any]]) -> None:
    port, pid = training
    prometheus = shipped_prometheus
    rules = json.loads(http_get(f"{prometheus.url}/api/v1/rules"))["data"]["groups"]
    assert {r["name"] for g in rules for r in g["rules"]} == \
        set(recording_rules()) | set(alerting_rules())
    # The last series to appear: steady steps and layers, through the recording rules.
    wait_for(lambda: all(prometheus.query(f"{rule} > 0") for rule in
                         (STEP_MEAN, LAYER_RATE)),
             "steady steps and layer times in the recording rules", 60)

    checked: list[str] = []
    owed: list[str] = []
    empty: list[str] = []

    def every_panel_answers() -> bool:
        for found in (checked, owed, empty):
            found.clear()
        for name, model in models.items():
            if name == JOB_FILE:
                continue  # no job_id here: tests/test_job_dashboard.py runs it on its series
            for panel in dashboards.panels(model):
                title = f"{name}: {panel['title']}"
                # Prometheus answers every query, GPU or not: the PromQL is valid.
                answers = [prometheus.query(substitute(t["expr"])) for t in panel["targets"]]
                if needs_gpu(panel):
                    owed.append(title)
                elif all(answers):
                    checked.append(title)
                else:
                    empty.append(title)
        return not empty

    # A rate needs two scrapes of its series, and a finding a window of passes, which
    # a loaded machine (a CI run with four workers on two cores) can delay by minutes.
    with contextlib.suppress(AssertionError):
        wait_for(every_panel_answers, "a series for every panel but GPU ones", 180)
    assert empty == [], "no series for these panels; only GPU and kernel panels may be empty"
    assert sorted(owed) == sorted(owed_to_gpu(
        {name: model for name, model in models.items() if name != JOB_FILE}))
    print(f"\n{len(checked)} panels checked for data here, {len(owed)} owed to a GPU machine")

    # The variables' label_values() queries, as Grafana sends them.
    values: dict[str, list[str]] = {}
    for variable in models["gpu.json"]["templating"]["list"]:
        if variable["type"] != "query":
            continue
        match = LABEL_VALUES.fullmatch(variable["query"])
        assert match, variable["query"]
        url = (f"{prometheus.url}/api/v1/label/{match['label']}/values?"
               + urllib.parse.urlencode({"match[]": substitute(match["selector"])}))
        answer = json.loads(http_get(url))
        assert answer["status"] == "success", answer
        values[variable["name"]] = answer["data"]
    assert values == {"job": ["dlprof"], "instance": [f"127.0.0.1:{port}"],
                      "pid": [str(pid)], "gpu": []}
