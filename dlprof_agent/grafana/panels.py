"""What the dashboards are made of: the selectors their queries use, the panel
builders, and the assembly of rows into a dashboard.

Queries select the job and the agent with `job=~"$job",instance=~"$instance"`,
processes with `pid=~"$pid"` and devices with `gpu=~"$gpu"`; host, GPU and
agent metrics carry no `pid`. Some panels read the recording rules of
deploy/prometheus/rules.yml (the names with colons, from
exporters/prometheus_rules.py), so that Prometheus must load those rules.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog import variants
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dashboard_models
from grafana_foundation_sdk.models import prometheus as prometheus_models

# Served by the probe's CUPTI tracer (probe/kernel_tracer.py) in a job that uses
# CUDA; elsewhere the panels that read them stay empty, like the GPU panels on a
# machine without a GPU. Name -> labels (a histogram's labels without `le`).
KERNEL_METRICS: dict[str, tuple[str, ...]] = {
    "dlprof_layer_gpu_seconds_total": ("pid", "layer", "phase"),
    "dlprof_kernel_seconds_total": ("pid", "gpu", "kernel"),
    "dlprof_kernel_launches_total": ("pid", "gpu", "kernel"),
    "dlprof_kernel_duration_seconds": ("pid", "gpu"),
    "dlprof_memcpy_bytes_total": ("pid", "gpu", "kind"),  # kind: h2d, d2h, d2d, p2p
    "dlprof_memcpy_seconds_total": ("pid", "gpu", "kind"),
    "dlprof_cupti_overhead_seconds_total": ("pid",),
    "dlprof_cupti_dropped_records_total": ("pid",),
    # state: active, busy, unavailable; reason: why busy or unavailable, "" otherwise
    "dlprof_kernel_tracing_state": ("pid", "state", "reason"),
}

# Every query and variable goes to the Prometheus the `datasource` variable picks.
DATASOURCE = dashboard_models.DataSourceRef(type_val="prometheus", uid="${datasource}")
JOB = 'job=~"$job",instance=~"$instance"'
PROCESS = JOB + ',pid=~"$pid"'
DEVICE = JOB + ',gpu=~"$gpu"'
PROCESS_DEVICE = PROCESS + ',gpu=~"$gpu"'
# CPU seconds that are CPU use: iowait is time blocked on block I/O.
BUSY = ',mode=~"user|system"'
PROCESS_BUSY = PROCESS + BUSY
PROCESS_SYSTEM = PROCESS + ',mode="system"'
HOST_BUSY = JOB + ',mode!="idle"'
STEADY = PROCESS + ',phase="steady"'
INVOLUNTARY = PROCESS + ',kind="involuntary"'

# (expr, legend) of one query; a panel's queries get refIds A, B, ...
Query = tuple[str, str]
Panel = timeseries.Panel | stat.Panel | table.Panel
# Threshold steps, lowest first: (from value, colour); the first starts at None.
Steps = Sequence[tuple[float | None, str]]
NEUTRAL: Steps = ((None, "blue"),)  # no value is good or bad in itself
SYSTEM_SHARE: Steps = ((None, "green"), (0.2, "orange"), (0.4, "red"))
GPU_BUSY: Steps = ((None, "red"), (0.5, "orange"), (0.8, "green"))
RUN_QUEUE: Steps = ((None, "green"), (1.0, "orange"), (1.5, "red"))
# Preemptions per CPU-second: a thread alone on a core is preempted a few times a
# second; threads sharing cores lose the CPU every scheduler slice (a few ms).
PREEMPTIONS: Steps = ((None, "green"), (50.0, "orange"), (200.0, "red"))
ANY_ERROR: Steps = ((None, "green"), (1.0, "red"))
TEMPERATURE: Steps = ((None, "green"), (80.0, "orange"), (90.0, "red"))


def rate(metric: str, selector: str, window: str = "$__rate_interval") -> str:
    return f"rate({metric}{{{selector}}}[{window}])"


def thresholds(steps: Steps) -> dashboard_builders.ThresholdsConfig:
    return (dashboard_builders.ThresholdsConfig().mode(dashboard_models.ThresholdsMode.ABSOLUTE)
            .steps([dashboard_models.Threshold(value=value, color=color)
                    for value, color in steps]))


def targets(queries: Sequence[Query], *, instant: bool = False
             ) -> list[Builder[variants.Dataquery]]:
    targets: list[Builder[variants.Dataquery]] = []
    for i, (expr, legend) in enumerate(queries):
        target = (prometheus.Dataquery().expr(expr).legend_format(legend)
                  .ref_id(chr(ord("A") + i)).datasource(DATASOURCE))
        if instant:
            target = target.instant().format(prometheus_models.PromQueryFormat.TABLE)
        targets.append(target)
    return targets


def time_series(title: str, description: str, unit: str, queries: Sequence[Query], *,
                width: int = 8, stacked: bool = False, axis_label: str | None = None,
                steps: Steps = NEUTRAL) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).description(description).unit(unit)
             .datasource(DATASOURCE).targets(targets(queries))
             .span(width).height(8).min(0).thresholds(thresholds(steps))
             .legend(common_builders.VizLegendOptions()
                     .display_mode(common.LegendDisplayMode.LIST)
                     .placement(common.LegendPlacement.BOTTOM).show_legend(True))
             .tooltip(common_builders.VizTooltipOptions()
                      .mode(common.TooltipDisplayMode.MULTI)
                      .sort(common.SortOrder.DESCENDING)))
    if steps is not NEUTRAL:
        # Draw the bands so a glance shows which side of the line the job is on.
        panel = panel.thresholds_style(common_builders.GraphThresholdsStyleConfig()
                                       .mode(common.GraphTresholdsStyleMode.DASHED_AND_AREA))
    if stacked:
        panel = (panel.fill_opacity(30)
                 .stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL)))
    else:
        panel = panel.fill_opacity(10)
    if axis_label is not None:
        panel = panel.axis_label(axis_label)
    return panel


def stat_panel(title: str, description: str, unit: str, expr: str, *, steps: Steps = NEUTRAL,
          mappings: list[dashboard_models.ValueMapping] | None = None,
          legend: str | None = None, width: int = 4, height: int = 4) -> stat.Panel:
    # NEUTRAL by default: Grafana's own thresholds would paint any value above 80
    # (every byte count) red.
    panel = (stat.Panel().title(title).description(description).unit(unit)
             .datasource(DATASOURCE).targets(targets([(expr, legend or title)]))
             .span(width).height(height)
             .graph_mode(common.BigValueGraphMode.AREA)
             .color_mode(common.BigValueColorMode.VALUE)
             .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]))
             .thresholds(thresholds(steps)))
    if mappings is not None:
        panel = panel.mappings(mappings)
    return panel


def table_panel(title: str, description: str, expr: str, hidden: Sequence[str]) -> table.Panel:
    """The labels of an info metric's series, one row per series, now."""
    organize = dashboard_models.DataTransformerConfig(
        id_val="organize", options={"excludeByName": dict.fromkeys(hidden, True)})
    return (table.Panel().title(title).description(description).unit("string")
            .datasource(DATASOURCE).targets(targets([(expr, "")], instant=True))
            .span(24).height(6).thresholds(thresholds(NEUTRAL)).show_header(True)
            .with_transformation(organize))


def value_states(*states: tuple[str, str, str]) -> list[dashboard_models.ValueMapping]:
    """Value -> (text, colour) mappings of a 0/1 gauge."""
    return [dashboard_models.ValueMap(options={
        value: dashboard_models.ValueMappingResult(text=text, color=color, index=i)
        for i, (value, text, color) in enumerate(states)})]


# ---- Assembly -----------------------------------------------------------------------


def _query_variable(name: str, label: str, query: str, *, every: bool
                    ) -> dashboard_builders.QueryVariable:
    variable = (dashboard_builders.QueryVariable(name).id(name).label(label).query(query)
                .datasource(DATASOURCE)
                .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
                .sort(dashboard_models.VariableSort.NUMERICAL_ASC if every
                      else dashboard_models.VariableSort.ALPHABETICAL_ASC))
    if every:
        # Match every value, also those (new processes) that appear after the page loaded.
        variable = variable.multi(True).include_all(True).all_value(".*")
    return variable


def _variables(*, gpu: bool) -> list[Builder[dashboard_models.VariableModel]]:
    variables: list[Builder[dashboard_models.VariableModel]] = [
        dashboard_builders.DatasourceVariable("datasource").id("datasource")
        .label("Data source").type("prometheus"),
        _query_variable("job", "Job", "label_values(dlprof_target_up, job)", every=False),
        _query_variable("instance", "Agent",
                        'label_values(dlprof_target_up{job=~"$job"}, instance)', every=True),
        _query_variable("pid", "Process", f"label_values(dlprof_process_info{{{JOB}}}, pid)",
                        every=True),
    ]
    if gpu:
        variables.append(_query_variable(
            "gpu", "GPU", f"label_values(dlprof_gpu_info{{{JOB}}}, gpu)", every=True))
    return variables


def dashboard(uid: str, title: str, description: str,
               rows: Sequence[tuple[str, Sequence[Panel]]], *, gpu: bool,
               variables: Sequence[Builder[dashboard_models.VariableModel]] | None = None
               ) -> dict[str, Any]:
    """``variables``: instead of the data source, job, agent and process (and GPU)."""
    ids = itertools.count(1)
    # The other dashboards, one click away, with the same variables and time range.
    others = (dashboard_builders.DashboardLink("dlprof-agent")
              .type(dashboard_models.DashboardLinkType.DASHBOARDS).tags(["dlprof-agent"])
              .as_dropdown(True).include_vars(True).keep_time(True))
    builder = (dashboard_builders.Dashboard(title).uid(uid).description(description)
               .tags(["dlprof-agent"]).links([others])
               .time("now-30m", "now").refresh("10s")
               .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
               .variables(_variables(gpu=gpu) if variables is None else list(variables)))
    for row_title, row_panels in rows:
        builder = builder.with_row(dashboard_builders.Row(row_title).id(next(ids)))
        for panel in row_panels:
            builder = builder.with_panel(panel.id(next(ids)))
    model: dict[str, Any] = json.loads(json.dumps(builder.build(), cls=JSONEncoder))
    return model
