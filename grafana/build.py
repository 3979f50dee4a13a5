"""The shipped Grafana dashboards, built with the grafana-foundation-sdk.

`build_overview()` returns the dashboard JSON model; `write()` stores every
dashboard in `dashboards/` next to this module, where the package ships them.
Regenerate after a change with:

    python -m dlprof_agent.grafana.build [--out DIR]

Queries select the job with `job=~"$job"` and, for per-process metrics, the
processes with `pid=~"$pid"`; host, GPU and agent metrics carry no `pid`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog import variants
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dashboard_models

DEFAULT_DIRECTORY = Path(__file__).parent / "dashboards"

# Every query and variable goes to the Prometheus the `datasource` variable picks.
DATASOURCE = dashboard_models.DataSourceRef(type_val="prometheus", uid="${datasource}")
JOB = 'job=~"$job"'
PROCESS = 'job=~"$job",pid=~"$pid"'
# CPU seconds that are CPU use: iowait is time blocked on block I/O.
PROCESS_BUSY = PROCESS + ',mode=~"user|system"'
PROCESS_SYSTEM = PROCESS + ',mode="system"'
HOST_BUSY = JOB + ',mode!="idle"'

# (expr, legend) of one query; a panel's queries get refIds A, B, ...
Query = tuple[str, str]
Panel = timeseries.Panel | stat.Panel


def _rate(metric: str, selector: str) -> str:
    return f"rate({metric}{{{selector}}}[$__rate_interval])"


def _targets(queries: Sequence[Query]) -> list[Builder[variants.Dataquery]]:
    return [prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + i))
            .datasource(DATASOURCE)
            for i, (expr, legend) in enumerate(queries)]


def _timeseries(title: str, description: str, unit: str, queries: Sequence[Query], *,
                width: int = 8, stacked: bool = False, axis_label: str | None = None,
                ) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).description(description).unit(unit)
             .datasource(DATASOURCE).targets(_targets(queries))
             .span(width).height(8).min(0)
             .legend(common_builders.VizLegendOptions()
                     .display_mode(common.LegendDisplayMode.LIST)
                     .placement(common.LegendPlacement.BOTTOM).show_legend(True))
             .tooltip(common_builders.VizTooltipOptions()
                      .mode(common.TooltipDisplayMode.MULTI)
                      .sort(common.SortOrder.DESCENDING)))
    if stacked:
        panel = (panel.fill_opacity(30)
                 .stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL)))
    else:
        panel = panel.fill_opacity(10)
    if axis_label is not None:
        panel = panel.axis_label(axis_label)
    return panel


def _stat(title: str, description: str, unit: str, expr: str,
          mappings: list[dashboard_models.ValueMapping] | None = None) -> stat.Panel:
    # A single neutral step: Grafana's default thresholds would paint any value
    # above 80 (every byte count) red.
    panel = (stat.Panel().title(title).description(description).unit(unit)
             .datasource(DATASOURCE).targets(_targets([(expr, title)]))
             .span(4).height(4)
             .graph_mode(common.BigValueGraphMode.AREA)
             .color_mode(common.BigValueColorMode.VALUE)
             .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]))
             .thresholds(dashboard_builders.ThresholdsConfig()
                         .mode(dashboard_models.ThresholdsMode.ABSOLUTE)
                         .steps([dashboard_models.Threshold(value=None, color="blue")])))
    if mappings is not None:
        panel = panel.mappings(mappings)
    return panel


def _overview_stats() -> list[Panel]:
    up = dashboard_models.ValueMap(options={
        "0": dashboard_models.ValueMappingResult(text="exited", color="red", index=0),
        "1": dashboard_models.ValueMappingResult(text="up", color="green", index=1),
    })
    return [
        _stat("Target up",
              "1 while the attached process runs, 0 once it exited. No value: Prometheus "
              "does not scrape the agent.",
              "short", f"min(dlprof_target_up{{{JOB}}})", [up]),
        _stat("CPU cores used",
              "Cores the job keeps busy (user + system). Compare with the host's cores.",
              "short",
              f"sum({_rate('dlprof_process_cpu_seconds_total', PROCESS_BUSY)})"),
        _stat("Resident memory",
              "Resident memory of the selected processes together; growth that never levels "
              "off is a leak.",
              "bytes", f"sum(dlprof_process_resident_memory_bytes{{{PROCESS}}})"),
        _stat("Threads",
              "Threads of the selected processes. Many more busy threads than cores "
              "means oversubscription: watch the system share.",
              "short", f"sum(dlprof_process_threads{{{PROCESS}}})"),
        _stat("GPU utilization",
              "Mean share of time a kernel ran on the job's GPUs. Low while the CPU is "
              "busy means the GPU waits for input.",
              "percentunit", f"avg(dlprof_gpu_utilization_ratio{{{JOB}}})"),
        _stat("GPU memory of the job",
              "Device memory the selected processes hold, on all GPUs.",
              "bytes", f"sum(dlprof_process_gpu_memory_bytes{{{PROCESS}}})"),
    ]


def _cpu() -> list[Panel]:
    cpu = "dlprof_process_cpu_seconds_total"
    return [
        _timeseries(
            "CPU by mode",
            "user is your code and libraries, system the kernel working for it; iowait "
            "is time blocked on disk reads, not CPU use. iowait rising means the input "
            "pipeline waits on storage.",
            "short", [(f"sum by (mode) ({_rate(cpu, PROCESS)})", "{{mode}}")],
            axis_label="cores"),
        _timeseries(
            "System share of CPU",
            "System time rising with thread count means oversubscription: more threads "
            "than cores, and the kernel busy switching between them.",
            "percentunit",
            [(f"sum({_rate(cpu, PROCESS_SYSTEM)}) / sum({_rate(cpu, PROCESS_BUSY)})",
              "system share")]),
        _timeseries(
            "Context switches",
            "involuntary: threads preempted, more runnable threads than cores. "
            "voluntary: threads waiting on locks, I/O or sleeps.",
            "ops",
            [(f"sum by (kind) ({_rate('dlprof_process_context_switches_total', PROCESS)})",
              "{{kind}}")]),
        _timeseries(
            "CPU by thread group",
            "Which threads burn the CPU (data loaders, the Python main thread, OpenMP or "
            "NCCL pools). One group pinned near 1 core while the GPU idles is a "
            "single-thread or GIL bottleneck.",
            "short",
            [("sum by (thread_name) ("
              + _rate("dlprof_thread_group_cpu_seconds_total", PROCESS + ',mode!="iowait"')
              + ")", "{{thread_name}}")],
            width=12, stacked=True, axis_label="cores"),
        _timeseries(
            "Host CPU by mode",
            "Busy cores of the whole host against its logical CPUs. A busy host with a "
            "quiet job means neighbours compete for CPU; steal means the hypervisor does.",
            "short",
            [(f"sum by (mode) ({_rate('dlprof_host_cpu_seconds_total', HOST_BUSY)})",
              "{{mode}}"),
             (f'sum(dlprof_host_cpus{{{JOB},kind="logical"}})', "logical CPUs")],
            width=12, axis_label="cores"),
    ]


def _memory() -> list[Panel]:
    return [
        _timeseries(
            "Resident memory per process",
            "Peak above resident means spikes between samples: size memory limits by the "
            "peak. Steady growth is a leak or an unbounded cache.",
            "bytes",
            [(f"max by (pid) (dlprof_process_resident_memory_bytes{{{PROCESS}}})",
              "{{pid}} resident"),
             (f"max by (pid) (dlprof_process_resident_memory_peak_bytes{{{PROCESS}}})",
              "{{pid}} peak")]),
        _timeseries(
            "Host memory available",
            "Available falling toward zero squeezes the page cache; swapping or the OOM "
            "killer comes next.",
            "bytes",
            [(f"sum by (instance) (dlprof_host_memory_available_bytes{{{JOB}}})",
              "{{instance}} available"),
             (f"sum by (instance) (dlprof_host_memory_total_bytes{{{JOB}}})",
              "{{instance}} total")]),
        _timeseries(
            "Swap in/out",
            "Any sustained swap-in means the host is out of memory and steps stall on "
            "disk; it shows as iowait too.",
            "Bps",
            [(f"sum by (direction) ({_rate('dlprof_host_swap_io_bytes_total', JOB)})",
              "{{direction}}")]),
    ]


def _io() -> list[Panel]:
    return [
        _timeseries(
            "Storage I/O",
            "Bytes that reached the storage device. High reads together with iowait mean "
            "the input pipeline is bound by the disk.",
            "Bps",
            [(f"sum by (direction) ({_rate('dlprof_process_io_bytes_total', PROCESS)})",
              "{{direction}}")],
            width=12),
        _timeseries(
            "Logical I/O",
            "Bytes through read and write calls, page-cache hits included. Far above "
            "storage I/O means the page cache serves the data set.",
            "Bps",
            [(f"sum by (direction) ({_rate('dlprof_process_io_logical_bytes_total', PROCESS)})",
              "{{direction}}")],
            width=12),
    ]


def _gpu() -> list[Panel]:
    gpu = "{{instance}} GPU {{gpu}}"
    return [
        _timeseries(
            "GPU utilization",
            "Share of time a kernel ran, not how full the SMs were. Dips between steps "
            "mean the GPU waits on the CPU, the input pipeline or communication.",
            "percentunit", [(f"dlprof_gpu_utilization_ratio{{{JOB}}}", gpu)]),
        _timeseries(
            "GPU memory-controller utilization",
            "Share of time device memory was read or written. High with low kernel time "
            "elsewhere points to a memory-bound model.",
            "percentunit", [(f"dlprof_gpu_memory_utilization_ratio{{{JOB}}}", gpu)]),
        _timeseries(
            "GPU memory used vs total",
            "Used close to total risks out-of-memory errors; far below leaves room for a "
            "larger batch.",
            "bytes",
            [(f"dlprof_gpu_memory_used_bytes{{{JOB}}}", f"{gpu} used"),
             (f"dlprof_gpu_memory_total_bytes{{{JOB}}}", f"{gpu} total")]),
        _timeseries(
            "PCIe throughput",
            "Sustained host-to-device traffic during steps means data is copied every "
            "step: pin memory, prefetch, or keep it on the GPU.",
            "Bps",
            [(f'dlprof_gpu_pcie_throughput_bytes_per_second{{{JOB},direction="rx"}}',
              f"{gpu} host to device"),
             (f'dlprof_gpu_pcie_throughput_bytes_per_second{{{JOB},direction="tx"}}',
              f"{gpu} device to host")]),
        _timeseries(
            "GPU power",
            "Draw pinned at the limit means the GPU is power capped; see the throttle "
            "reasons.",
            "watt",
            [(f"dlprof_gpu_power_watts{{{JOB}}}", f"{gpu} draw"),
             (f"dlprof_gpu_power_limit_watts{{{JOB}}}", f"{gpu} limit")]),
        _timeseries(
            "GPU clocks",
            "Clocks dropping under load mean power or thermal throttling.",
            "hertz", [(f"dlprof_gpu_clock_hertz{{{JOB}}}", f"{gpu} {{{{clock}}}}")]),
        _timeseries(
            "GPU throttle reasons",
            "Each line is a reason holding the clocks down. sw_power_cap under full load "
            "is common; hw_slowdown or thermal reasons point to cooling or power supply.",
            "short",
            [(f"dlprof_gpu_throttle_reason_active{{{JOB}}} > 0", f"{gpu} {{{{reason}}}}")],
            width=12),
        _timeseries(
            "GPU temperature",
            "Temperature climbing toward the slowdown point comes before thermal "
            "throttling.",
            "celsius", [(f"dlprof_gpu_temperature_celsius{{{JOB}}}", gpu)], width=12),
        _timeseries(
            "GPU memory per process",
            "Which process holds device memory. A data-loader worker here has initialised "
            "CUDA, which is usually a mistake.",
            "bytes",
            [(f"sum by (pid, gpu) (dlprof_process_gpu_memory_bytes{{{PROCESS}}})",
              "pid {{pid}} GPU {{gpu}}")],
            width=12),
        _timeseries(
            "SM utilization per process",
            "Each process's share of time with a kernel on the SMs. Processes sharing a "
            "GPU compete for it.",
            "percentunit",
            [(f"sum by (pid, gpu) (dlprof_process_gpu_sm_utilization_ratio{{{PROCESS}}})",
              "pid {{pid}} GPU {{gpu}}")],
            width=12),
    ]


def _agent() -> list[Panel]:
    return [
        _timeseries(
            "Agent sample duration",
            "Time one sampling pass takes. Close to the interval means the agent falls "
            "behind and samples age.",
            "s",
            [(f"dlprof_agent_sample_duration_seconds{{{JOB}}}", "{{instance}} duration"),
             (f"dlprof_agent_interval_seconds{{{JOB}}}", "{{instance}} interval")]),
        _timeseries(
            "Agent CPU",
            "CPU the agent itself uses; it should stay a small fraction of one core.",
            "short", [(_rate("dlprof_agent_cpu_seconds_total", JOB), "{{instance}}")],
            axis_label="cores"),
        _timeseries(
            "Collector errors",
            "Failed reads per second by collector; anything above 0 is logged once by the "
            "agent, so check its log.",
            "ops",
            [(f"sum by (collector) ({_rate('dlprof_collector_errors_total', JOB)})",
              "{{collector}}")]),
    ]


def _variables() -> list[Builder[dashboard_models.VariableModel]]:
    return [
        dashboard_builders.DatasourceVariable("datasource").id("datasource").label("Data source")
        .type("prometheus"),
        dashboard_builders.QueryVariable("job").id("job").label("Job")
        .query("label_values(dlprof_target_up, job)").datasource(DATASOURCE)
        .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard_models.VariableSort.ALPHABETICAL_ASC),
        dashboard_builders.QueryVariable("pid").id("pid").label("Process")
        .query('label_values(dlprof_process_info{job=~"$job"}, pid)').datasource(DATASOURCE)
        .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard_models.VariableSort.NUMERICAL_ASC)
        .multi(True).include_all(True)
        # Match every process, also children that start after the page loaded.
        .all_value(".*"),
    ]


def build_overview() -> dict[str, Any]:
    """The "where the time goes" dashboard as a Grafana JSON model."""
    ids = itertools.count(1)
    builder = (dashboard_builders.Dashboard("dlprof-agent: where the time goes")
               .uid("dlprof-overview")
               .description("CPU, memory, I/O and GPU of a training job, from dlprof-agent.")
               .tags(["dlprof-agent"])
               .time("now-30m", "now").refresh("10s")
               .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
               .variables(_variables()))
    rows = [("Overview", _overview_stats()), ("CPU", _cpu()), ("Memory", _memory()),
            ("I/O", _io()), ("GPU", _gpu()), ("Agent", _agent())]
    for title, panels in rows:
        builder = builder.with_row(dashboard_builders.Row(title).id(next(ids)))
        for panel in panels:
            builder = builder.with_panel(panel.id(next(ids)))
    model: dict[str, Any] = json.loads(json.dumps(builder.build(), cls=JSONEncoder))
    return model


def dashboards() -> dict[str, dict[str, Any]]:
    """Every shipped dashboard by its file name."""
    return {"overview.json": build_overview()}


def render(model: dict[str, Any]) -> str:
    """A model as the text of its file."""
    return json.dumps(model, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write(directory: Path) -> list[Path]:
    """Write every dashboard into `directory`; return the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, model in dashboards().items():
        path = directory / name
        path.write_text(render(model), encoding="utf-8")
        written.append(path)
    return written


def panels(model: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel of a model that is not a row, also those inside collapsed rows."""
    for panel in model.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def queries(model: dict[str, Any]) -> list[str]:
    """Every PromQL `expr` of a model's panels, in panel order."""
    return [target["expr"] for panel in panels(model)
            for target in panel.get("targets", []) if "expr" in target]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dlprof_agent.grafana.build",
        description="Write the Grafana dashboards as JSON.")
    parser.add_argument("--out", type=Path, default=DEFAULT_DIRECTORY, metavar="DIR",
                        help="folder to write into (default: %(default)s)")
    args = parser.parse_args(argv)
    for path in write(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
