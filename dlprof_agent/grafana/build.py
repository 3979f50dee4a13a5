"""The shipped Grafana dashboards, built with the grafana-foundation-sdk.

`dashboards()` returns every dashboard's JSON model by file name; `write()`
stores them in `dashboards/` next to this module, where the package ships them.
Regenerate after a change with:

    python -m dlprof_agent.grafana.build [--out DIR]

Queries select the job and the agent with `job=~"$job",instance=~"$instance"`,
processes with `pid=~"$pid"` and devices with `gpu=~"$gpu"`; host, GPU and
agent metrics carry no `pid`. Some panels read the recording rules of
deploy/prometheus/rules.yml (the names with colons below), so that Prometheus
must load those rules.
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
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog import variants
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dashboard_models
from grafana_foundation_sdk.models import prometheus as prometheus_models

from dlprof_agent.model.findings import KINDS

DEFAULT_DIRECTORY = Path(__file__).parent / "dashboards"

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

# Recording rules of deploy/prometheus/rules.yml (level:metric:operations). They
# precompute the rates that several panels share or that topk() would otherwise
# compute over hundreds of layer or kernel series on every refresh.
CPU_RATE = "instance_pid_mode:dlprof_process_cpu_seconds:rate1m"
THREAD_CPU_RATE = "instance_pid_thread_name_mode:dlprof_thread_group_cpu_seconds:rate1m"
STEP_MEAN = "instance_pid:dlprof_step_duration_seconds:mean1m"
LAYER_RATE = "instance_pid_layer_phase:dlprof_layer_seconds:rate1m"
KERNEL_RATE = "instance_pid_gpu_kernel:dlprof_kernel_seconds:rate1m"

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


def _rate(metric: str, selector: str, window: str = "$__rate_interval") -> str:
    return f"rate({metric}{{{selector}}}[{window}])"


def _thresholds(steps: Steps) -> dashboard_builders.ThresholdsConfig:
    return (dashboard_builders.ThresholdsConfig().mode(dashboard_models.ThresholdsMode.ABSOLUTE)
            .steps([dashboard_models.Threshold(value=value, color=color)
                    for value, color in steps]))


def _targets(queries: Sequence[Query], *, instant: bool = False
             ) -> list[Builder[variants.Dataquery]]:
    targets: list[Builder[variants.Dataquery]] = []
    for i, (expr, legend) in enumerate(queries):
        target = (prometheus.Dataquery().expr(expr).legend_format(legend)
                  .ref_id(chr(ord("A") + i)).datasource(DATASOURCE))
        if instant:
            target = target.instant().format(prometheus_models.PromQueryFormat.TABLE)
        targets.append(target)
    return targets


def _timeseries(title: str, description: str, unit: str, queries: Sequence[Query], *,
                width: int = 8, stacked: bool = False, axis_label: str | None = None,
                steps: Steps = NEUTRAL) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).description(description).unit(unit)
             .datasource(DATASOURCE).targets(_targets(queries))
             .span(width).height(8).min(0).thresholds(_thresholds(steps))
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


def _stat(title: str, description: str, unit: str, expr: str, *, steps: Steps = NEUTRAL,
          mappings: list[dashboard_models.ValueMapping] | None = None,
          legend: str | None = None, width: int = 4, height: int = 4) -> stat.Panel:
    # NEUTRAL by default: Grafana's own thresholds would paint any value above 80
    # (every byte count) red.
    panel = (stat.Panel().title(title).description(description).unit(unit)
             .datasource(DATASOURCE).targets(_targets([(expr, legend or title)]))
             .span(width).height(height)
             .graph_mode(common.BigValueGraphMode.AREA)
             .color_mode(common.BigValueColorMode.VALUE)
             .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]))
             .thresholds(_thresholds(steps)))
    if mappings is not None:
        panel = panel.mappings(mappings)
    return panel


def _table(title: str, description: str, expr: str, hidden: Sequence[str]) -> table.Panel:
    """The labels of an info metric's series, one row per series, now."""
    organize = dashboard_models.DataTransformerConfig(
        id_val="organize", options={"excludeByName": dict.fromkeys(hidden, True)})
    return (table.Panel().title(title).description(description).unit("string")
            .datasource(DATASOURCE).targets(_targets([(expr, "")], instant=True))
            .span(24).height(6).thresholds(_thresholds(NEUTRAL)).show_header(True)
            .with_transformation(organize))


def _states(*states: tuple[str, str, str]) -> list[dashboard_models.ValueMapping]:
    """Value -> (text, colour) mappings of a 0/1 gauge."""
    return [dashboard_models.ValueMap(options={
        value: dashboard_models.ValueMappingResult(text=text, color=color, index=i)
        for i, (value, text, color) in enumerate(states)})]


# ---- Overview: where the time goes --------------------------------------------------


def _findings() -> stat.Panel:
    """One tile per finding the agent judged for the selected processes."""
    catalogue = "\n".join(f"- **{kind.id}** ({kind.severity}): {kind.summary}. Try: "
                           f"{kind.advice}." for kind in KINDS)
    return (_stat(
        "Findings",
        "What the agent concludes about the job, judged on its own clock over the last few "
        "seconds: a tile per rule that had something to judge, *holds* while the cause "
        "has held for a few seconds, *clear* otherwise. The figures behind each are in "
        "`dlprof_finding_evidence{finding=\"...\"}`, and in the agent's summary. A rule "
        "without a tile had nothing to judge (no probe, no GPU, no steady steps yet); "
        "docs/findings.md gives every rule and its thresholds.\n\n" + catalogue,
        "short", f"max by (pid, finding, severity) (dlprof_finding{{{PROCESS}}})",
        legend="{{finding}} ({{severity}}), pid {{pid}}", width=24, height=4,
        steps=((None, "green"), (1.0, "red")),
        mappings=_states(("0", "clear", "green"), ("1", "holds", "red")))
        .text_mode(common.BigValueTextMode.VALUE_AND_NAME)
        .graph_mode(common.BigValueGraphMode.NONE))


def _overview_stats() -> list[Panel]:
    return [
        _findings(),
        _stat("Target up",
              "1 while the attached process runs, 0 once it exited. No value: Prometheus "
              "does not scrape the agent; check the scrape targets page.",
              "short", f"min(dlprof_target_up{{{JOB}}})",
              mappings=_states(("0", "exited", "red"), ("1", "up", "green"))),
        _stat("Probe",
              "Whether the agent reads the probe inside the job. Without it there is no step "
              "time, samples/s or layers: start the job with `dlprof-agent run`, or see the "
              "agent's log for why injection was refused.",
              "short", f"min(dlprof_probe_up{{{PROCESS}}})",
              mappings=_states(("0", "none", "orange"), ("1", "reading", "green"))),
        _stat("Samples per second",
              "Training throughput over steady-state steps, all selected processes. The "
              "number to compare between runs; a drop with a busy CPU points to input or "
              "oversubscription.",
              "short",
              f"sum({_rate('dlprof_samples_total', STEADY)})"),
        _stat("Mean step time",
              "Steady-state step time over the last minute, averaged over processes. "
              "Compare with the phases below to see where it goes.",
              "s", f"avg({STEP_MEAN}{{{PROCESS}}})"),
        _stat("CPU cores used",
              "Cores the job keeps busy (user + system). Near the host's core count means "
              "the CPU, not the GPU, sets the pace.",
              "short", f"sum({CPU_RATE}{{{PROCESS_BUSY}}})"),
        _stat("System share of CPU",
              "Share of the job's CPU spent in the kernel. Above 20% is suspicious, above 40% "
              "is oversubscription: lower the thread counts (OMP_NUM_THREADS, intra-op "
              "threads, data-loader workers).",
              "percentunit",
              f"sum({CPU_RATE}{{{PROCESS_SYSTEM}}}) / sum({CPU_RATE}{{{PROCESS_BUSY}}})",
              steps=SYSTEM_SHARE),
        _stat("Resident memory",
              "Resident memory of the selected processes together; growth that never levels "
              "off is a leak.",
              "bytes", f"sum(dlprof_process_resident_memory_bytes{{{PROCESS}}})"),
        _stat("Largest resident peak",
              "The highest resident memory any selected process reached since the agent "
              "attached, spikes between samples included. Size memory limits by this.",
              "bytes", f"max(dlprof_process_resident_memory_peak_bytes{{{PROCESS}}})"),
        _stat("Threads",
              "Threads of the selected processes. Many more busy threads than cores "
              "means oversubscription: watch the system share.",
              "short", f"sum(dlprof_process_threads{{{PROCESS}}})"),
        _stat("Run queue per core",
              "1-minute load over logical CPUs of the busiest host. Above 1 threads wait for "
              "a CPU: fewer threads or workers, or a bigger machine.",
              "short",
              f'max(dlprof_host_load_average{{{JOB},window="1m"}} / ignoring(window, kind) '
              f'dlprof_host_cpus{{{JOB},kind="logical"}})', steps=RUN_QUEUE),
        _stat("GPU utilization",
              "Mean share of time a kernel ran on the selected GPUs. Low (red) while the CPU "
              "is busy means the GPU waits for input: more loader workers, pinned memory, "
              "larger batches.",
              "percentunit", f"avg(dlprof_gpu_utilization_ratio{{{DEVICE}}})", steps=GPU_BUSY),
        _stat("GPU memory of the job",
              "Device memory the selected processes hold on the selected GPUs. Far below the "
              "GPU's memory leaves room for a larger batch.",
              "bytes", f"sum(dlprof_process_gpu_memory_bytes{{{PROCESS_DEVICE}}})"),
    ]


def _training() -> list[Panel]:
    return [
        _timeseries(
            "Step time",
            "Mean step time per process over the last minute, and the 90th percentile of "
            "all steps. A p90 far above the mean means some steps stall: look for "
            "periodic work (checkpoints, evaluation, garbage collection).",
            "s",
            [(f"max by (pid) ({STEP_MEAN}{{{PROCESS}}})", "{{pid}} mean"),
             ("histogram_quantile(0.9, sum by (le) ("
              + _rate("dlprof_step_duration_seconds_bucket", PROCESS) + "))", "p90")]),
        _timeseries(
            "Samples per second",
            "Steady-state throughput per process. The figure of merit: a change you make "
            "should raise this, not just the GPU utilization.",
            "short", [(f"sum by (pid) ({_rate('dlprof_samples_total', STEADY)})", "{{pid}}")],
            axis_label="samples/s"),
        _timeseries(
            "Warm-up and steady steps",
            "Steps counted since the agent attached. Warm-up steps (compilation, autotuning, "
            "allocator growth) are left out of the step time; a steady line that stops "
            "rising while the job runs means it hangs.",
            "short", [(f"sum by (phase) (dlprof_steps_total{{{PROCESS}}})", "{{phase}}")]),
        _timeseries(
            "Step time by phase",
            "Share of step time in forward, backward, optimizer and other. A large 'other' "
            "is time no hook sees, usually data loading: more workers, prefetching, or a "
            "faster input format.",
            "percentunit",
            [(f"sum by (phase) ({_rate('dlprof_step_phase_seconds_total', PROCESS)}) "
              f"/ ignoring(phase) group_left "
              f"sum({_rate('dlprof_step_duration_seconds_sum', PROCESS)})", "{{phase}}")],
            width=12, stacked=True),
        _timeseries(
            "Top layers",
            "The ten layers with the most CPU time (forward + backward) per process, as a "
            "share of wall time, over the last minute. Start optimising at the top; the "
            "layers dashboard splits the phases.",
            "percentunit",
            [(f"topk(10, avg by (layer) ({LAYER_RATE}{{{PROCESS}}}))", "{{layer}}")],
            width=12),
        _table(
            "Framework settings",
            "The settings the job's training thread runs with. Thread counts above the "
            "cores you give the job oversubscribe the CPU; cudnn_autotune off or fp32 "
            "precision on a GPU leave speed on the table.",
            f"dlprof_framework_info{{{PROCESS}}}",
            ["Time", "Value", "__name__", "job"]),
    ]


def _cpu() -> list[Panel]:
    return [
        _timeseries(
            "CPU by mode",
            "user is your code and libraries, system the kernel working for it; iowait "
            "is time blocked on disk reads, not CPU use. iowait rising means the input "
            "pipeline waits on storage: cache or prefetch the data set.",
            "short", [(f"sum by (mode) ({CPU_RATE}{{{PROCESS}}})", "{{mode}}")],
            axis_label="cores"),
        _timeseries(
            "System share of CPU",
            "System time rising with thread count means oversubscription: more threads "
            "than cores, and the kernel busy switching between them. Above 20% (amber) "
            "lower the thread counts; above 40% (red) they cost throughput.",
            "percentunit",
            [(f"sum({CPU_RATE}{{{PROCESS_SYSTEM}}}) / sum({CPU_RATE}{{{PROCESS_BUSY}}})",
              "system share")], steps=SYSTEM_SHARE),
        _timeseries(
            "Context switches",
            "involuntary: threads preempted, more runnable threads than cores: reduce "
            "threads. voluntary: threads waiting on locks, I/O or sleeps.",
            "ops",
            [(f"sum by (kind) ({_rate('dlprof_process_context_switches_total', PROCESS)})",
              "{{kind}}")]),
        _timeseries(
            "CPU by thread group",
            "Which threads burn the CPU (data loaders, the Python main thread, OpenMP or "
            "NCCL pools). One group pinned near 1 core while the GPU idles is a "
            "single-thread or GIL bottleneck: move work to worker processes.",
            "short",
            [(f'sum by (thread_name) ({THREAD_CPU_RATE}{{{PROCESS},mode!="iowait"}})',
              "{{thread_name}}")],
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
            "killer comes next. Fewer loader workers or a smaller shuffle buffer help.",
            "bytes",
            [(f"sum by (instance) (dlprof_host_memory_available_bytes{{{JOB}}})",
              "{{instance}} available"),
             (f"sum by (instance) (dlprof_host_memory_total_bytes{{{JOB}}})",
              "{{instance}} total")]),
        _timeseries(
            "Swap in/out",
            "Any sustained swap-in means the host is out of memory and steps stall on "
            "disk; it shows as iowait too. Free memory before tuning anything else.",
            "Bps",
            [(f"sum by (direction) ({_rate('dlprof_host_swap_io_bytes_total', JOB)})",
              "{{direction}}")]),
    ]


def _io() -> list[Panel]:
    return [
        _timeseries(
            "Storage I/O",
            "Bytes that reached the storage device. High reads together with iowait mean "
            "the input pipeline is bound by the disk: cache, shard or prefetch.",
            "Bps",
            [(f"sum by (direction) ({_rate('dlprof_process_io_bytes_total', PROCESS)})",
              "{{direction}}")],
            width=12),
        _timeseries(
            "Logical I/O",
            "Bytes through read and write calls, page-cache hits included. Far above "
            "storage I/O means the page cache serves the data set, as it should.",
            "Bps",
            [(f"sum by (direction) ({_rate('dlprof_process_io_logical_bytes_total', PROCESS)})",
              "{{direction}}")],
            width=12),
    ]


GPU_LEGEND = "{{instance}} GPU {{gpu}}"


def _gpu_utilization(width: int) -> timeseries.Panel:
    return _timeseries(
        "GPU utilization",
        "Share of time a kernel ran, not how full the SMs were. Red: the GPU mostly waits "
        "on the CPU, the input pipeline or communication; dips between steps say the same.",
        "percentunit", [(f"dlprof_gpu_utilization_ratio{{{DEVICE}}}", GPU_LEGEND)],
        width=width, steps=GPU_BUSY)


def _gpu_memory(width: int) -> timeseries.Panel:
    return _timeseries(
        "GPU memory used vs total",
        "Used close to total risks out-of-memory errors; far below leaves room for a "
        "larger batch.",
        "bytes",
        [(f"dlprof_gpu_memory_used_bytes{{{DEVICE}}}", f"{GPU_LEGEND} used"),
         (f"dlprof_gpu_memory_total_bytes{{{DEVICE}}}", f"{GPU_LEGEND} total")],
        width=width)


def _process_gpu_memory(width: int) -> timeseries.Panel:
    return _timeseries(
        "GPU memory per process",
        "Which process holds device memory. A data-loader worker here has initialised "
        "CUDA, which is usually a mistake: keep CUDA calls out of the dataset.",
        "bytes",
        [(f"sum by (pid, gpu) (dlprof_process_gpu_memory_bytes{{{PROCESS_DEVICE}}})",
          "pid {{pid}} GPU {{gpu}}")],
        width=width)


def _gpu_summary() -> list[Panel]:
    return [_gpu_utilization(8), _gpu_memory(8), _process_gpu_memory(8)]


def _agent() -> list[Panel]:
    return [
        _timeseries(
            "Agent sample duration",
            "Time one sampling pass takes. Close to the interval means the agent falls "
            "behind and samples age: raise --interval or drop --layers.",
            "s",
            [(f"dlprof_agent_sample_duration_seconds{{{JOB}}}", "{{instance}} duration"),
             (f"dlprof_agent_interval_seconds{{{JOB}}}", "{{instance}} interval")]),
        _timeseries(
            "Agent CPU",
            "CPU the agent itself uses, as a share of one core. Above 10% (amber) raise "
            "--interval; the agent should never compete with the job.",
            "percentunit", [(_rate("dlprof_agent_cpu_seconds_total", JOB), "{{instance}}")],
            steps=((None, "green"), (0.1, "orange"), (0.25, "red"))),
        _timeseries(
            "Collector errors",
            "Failed reads in the last 5 minutes by collector; anything above 0 (red) is "
            "logged once by the agent, so check its log.",
            "short",
            [(f"sum by (collector) (increase(dlprof_collector_errors_total{{{JOB}}}[5m]))",
              "{{collector}}")], steps=ANY_ERROR),
    ]


def build_overview() -> dict[str, Any]:
    """The "where the time goes" dashboard as a Grafana JSON model."""
    return _dashboard(
        "dlprof-overview", "dlprof-agent: where the time goes",
        "Step time, throughput, CPU, memory, I/O and GPU of a training job, from "
        "dlprof-agent.",
        [("Overview", _overview_stats()), ("Training", _training()), ("CPU", _cpu()),
         ("Memory", _memory()), ("I/O", _io()), ("GPU", _gpu_summary()),
         ("Agent", _agent())], gpu=True)


# ---- Layers and kernels -------------------------------------------------------------


def _layers() -> list[Panel]:
    def top(phase: str) -> Query:
        return (f'topk(10, avg by (layer) ({LAYER_RATE}{{{PROCESS},phase="{phase}"}}))',
                "{{layer}}")

    per_call = ("topk(10, sum by (layer, phase) ("
                + _rate("dlprof_layer_seconds_total", PROCESS) + ") / sum by (layer, phase) ("
                + _rate("dlprof_layer_calls_total", PROCESS) + "))")
    return [
        _timeseries(
            "Forward CPU time by layer",
            "The ten layers whose forward pass takes the most time, as a share of wall "
            "time per process. A cheap layer high here (normalization, activation) "
            "is worth fusing or compiling.",
            "percentunit", [top("forward")]),
        _timeseries(
            "Backward CPU time by layer",
            "The same for the backward pass. Backward far above twice the forward points "
            "to recomputation or an expensive custom gradient.",
            "percentunit", [top("backward")]),
        _timeseries(
            "Time per call",
            "Mean time of one call, by layer and phase. Much longer than its neighbours "
            "for a layer of similar size means a slow kernel or layout: try channels-last "
            "or another algorithm.",
            "s", [(per_call, "{{layer}} {{phase}}")]),
    ]


def _layer_gpu() -> list[Panel]:
    gpu_rate = "dlprof_layer_gpu_seconds_total"
    return [
        _timeseries(
            "GPU time by layer",
            "The ten layers whose kernels keep the GPU busiest, by phase, as a share of "
            "wall time. This, not the CPU time, is what to shrink on a GPU-bound job.",
            "percentunit",
            [(f"topk(10, avg by (layer, phase) ({_rate(gpu_rate, PROCESS)}))",
              "{{layer}} {{phase}}")],
            width=12),
        _timeseries(
            "GPU time per CPU second by layer",
            "GPU time of a layer's kernels for each second of its CPU time. Below 1 (red "
            "under 0.5) the layer is bound by launching kernels: larger batches, fused "
            "ops, torch.compile or CUDA graphs.",
            "short",
            [(f"topk(10, sum by (layer) ({_rate(gpu_rate, PROCESS)}) / sum by (layer) ("
              f"{_rate('dlprof_layer_seconds_total', PROCESS)}))", "{{layer}}")],
            width=12, steps=((None, "red"), (0.5, "orange"), (1.0, "green"))),
    ]


def _kernels() -> list[Panel]:
    duration = _rate("dlprof_kernel_duration_seconds_bucket", PROCESS_DEVICE)
    return [
        _timeseries(
            "Top kernels by time",
            "The ten kernels that keep each GPU busiest, over the last minute. One "
            "kernel dominating is the place to optimise; many small ones call for fusion.",
            "percentunit",
            [(f"topk(10, sum by (gpu, kernel) ({KERNEL_RATE}{{{PROCESS_DEVICE}}}))",
              "GPU {{gpu}} {{kernel}}")]),
        _timeseries(
            "Top kernels by launches",
            "The ten kernels launched most often. Thousands per second of a short kernel "
            "is launch overhead: fuse, batch, or capture the step in a CUDA graph.",
            "ops",
            [("topk(10, sum by (kernel) ("
              + _rate("dlprof_kernel_launches_total", PROCESS_DEVICE) + "))", "{{kernel}}")]),
        _timeseries(
            "Kernel duration",
            "Median and 99th percentile kernel time per GPU. A median under 10 µs (red) "
            "means launch overhead dominates: the GPU idles between tiny kernels.",
            "s",
            [(f"histogram_quantile(0.5, sum by (le, gpu) ({duration}))", "GPU {{gpu}} p50"),
             (f"histogram_quantile(0.99, sum by (le, gpu) ({duration}))", "GPU {{gpu}} p99")],
            steps=((None, "red"), (1e-5, "orange"), (5e-5, "green"))),
    ]


def _memcpy() -> list[Panel]:
    by_kind = "sum by (gpu, kind) ({})"
    copied = by_kind.format(_rate("dlprof_memcpy_bytes_total", PROCESS_DEVICE))
    copying = by_kind.format(_rate("dlprof_memcpy_seconds_total", PROCESS_DEVICE))
    return [
        _timeseries(
            "Copy throughput",
            "Bytes copied per second by direction (h2d host to device, d2h, d2d, p2p). "
            "Steady h2d traffic every step means data is copied each step: keep it on "
            "the GPU or prefetch.",
            "Bps", [(copied, "GPU {{gpu}} {{kind}}")]),
        _timeseries(
            "Copy time",
            "Share of wall time spent copying, by direction. Above 10% (amber) copies "
            "hold up compute: overlap them (non_blocking with pinned memory) or copy less.",
            "percentunit", [(copying, "GPU {{gpu}} {{kind}}")],
            steps=((None, "green"), (0.1, "orange"), (0.25, "red"))),
        _timeseries(
            "Copy bandwidth",
            "Bytes per second while a copy runs. h2d or d2h far below the link's speed "
            "(red under 2 GB/s) means pageable memory: pin it (pin_memory=True).",
            "Bps", [(f"{copied} / {copying}", "GPU {{gpu}} {{kind}}")],
            steps=((None, "red"), (2e9, "orange"), (8e9, "green"))),
    ]


def _tracer() -> list[Panel]:
    return [
        _timeseries(
            "CUPTI overhead",
            "Time the kernel tracer costs the job, as a share of wall time. Above 2% "
            "(amber) trace fewer activity kinds or for shorter windows.",
            "percentunit",
            [(f"sum by (pid) ({_rate('dlprof_cupti_overhead_seconds_total', PROCESS)})",
              "{{pid}}")],
            steps=((None, "green"), (0.02, "orange"), (0.05, "red"))),
        _timeseries(
            "Dropped CUPTI records",
            "Activity records lost in the last 5 minutes because the buffers were full; "
            "above 0 (red) the kernel figures undercount: give the tracer larger buffers.",
            "short",
            [(f"sum by (pid) (increase(dlprof_cupti_dropped_records_total{{{PROCESS}}}[5m]))",
              "{{pid}}")], steps=ANY_ERROR),
        _stat(
            "Kernel tracing state",
            "Processes per tracer state. busy: another profiler (Nsight, DCGM profiling) "
            "holds CUPTI, so stop it; unavailable: no CUPTI in this driver or container.",
            "short", f"count by (state) (dlprof_kernel_tracing_state{{{PROCESS}}} == 1)",
            legend="{{state}}", width=8, height=8),
    ]


def build_layers() -> dict[str, Any]:
    """Per-layer and per-kernel time as a Grafana JSON model."""
    return _dashboard(
        "dlprof-layers", "dlprof-agent: layers and kernels",
        "Per-layer CPU time from the in-process probe (--layers), and per-layer GPU time, "
        "kernels and memory copies from the CUPTI tracer.",
        [("Layers (CPU time)", _layers()), ("Layers (GPU time)", _layer_gpu()),
         ("Kernels", _kernels()), ("Memory copies", _memcpy()),
         ("Kernel tracer", _tracer())], gpu=True)


# ---- Threads and CPU ----------------------------------------------------------------


def _thread_stats() -> list[Panel]:
    switches = _rate("dlprof_process_context_switches_total", INVOLUNTARY)
    cpu = _rate("dlprof_process_cpu_seconds_total", PROCESS_BUSY)
    return [
        _stat("Threads", "Threads of the selected processes now. Compare the busy ones, "
              "below, with the cores.",
              "short", f"sum(dlprof_process_threads{{{PROCESS}}})"),
        _stat("Host logical CPUs", "Hardware threads of the host(s). Busy threads beyond "
              "this number wait for a CPU.",
              "short", f'sum(dlprof_host_cpus{{{JOB},kind="logical"}})'),
        _stat("CPU cores used", "Cores the job keeps busy (user + system), last minute. "
              "Near the logical CPUs means the job is CPU-bound: see which thread group "
              "below.",
              "short", f"sum({CPU_RATE}{{{PROCESS_BUSY}}})"),
        _stat("System share of CPU", "Kernel share of the job's CPU. Above 20% amber, 40% "
              "red: oversubscription; lower the thread counts.",
              "percentunit",
              f"sum({CPU_RATE}{{{PROCESS_SYSTEM}}}) / sum({CPU_RATE}{{{PROCESS_BUSY}}})",
              steps=SYSTEM_SHARE),
        _stat("Preemptions per CPU-second", "Involuntary context switches per second of "
              "CPU used. Above 50 (amber) threads share cores; above 200 (red) they fight "
              "for them: fewer threads.",
              "short", f"sum({switches}) / sum({cpu})", steps=PREEMPTIONS),
        _stat("Run queue per core", "1-minute load over logical CPUs. Above 1 runnable "
              "threads wait for a CPU.",
              "short",
              f'max(dlprof_host_load_average{{{JOB},window="1m"}} / ignoring(window, kind) '
              f'dlprof_host_cpus{{{JOB},kind="logical"}})', steps=RUN_QUEUE),
    ]


def _threads() -> list[Panel]:
    return [
        _timeseries(
            "Threads per process",
            "Live threads in each process. A count that keeps climbing is a thread leak; "
            "each data-loader worker is a process of its own here.",
            "short", [(f"sum by (pid) (dlprof_process_threads{{{PROCESS}}})", "{{pid}}")],
            width=12),
        _timeseries(
            "Threads per name",
            "Live threads by name, all selected processes. Several pools (OpenMP, MKL, the "
            "framework's inter-op pool) each sized to all cores oversubscribe the CPU.",
            "short",
            [(f"sum by (thread_name) (dlprof_thread_group_threads{{{PROCESS}}})",
              "{{thread_name}}")],
            width=12, stacked=True),
    ]


def _thread_cpu() -> list[Panel]:
    groups = f'{THREAD_CPU_RATE}{{{PROCESS},mode!="iowait"}}'
    return [
        _timeseries(
            "CPU by thread group",
            "Cores used by each thread name, last minute. The group that grows when the "
            "job slows is the bottleneck.",
            "short", [(f"sum by (thread_name) ({groups})", "{{thread_name}}")],
            width=12, stacked=True, axis_label="cores"),
        _timeseries(
            "CPU per thread",
            "A group's CPU over its thread count: how busy its average thread is. Near "
            "100% (amber) for the main thread is a single-thread or GIL bottleneck; low "
            "for a big pool means the pool is larger than the work.",
            "percentunit",
            [(f"sum by (thread_name) ({groups}) / sum by (thread_name) "
              f"(dlprof_thread_group_threads{{{PROCESS}}})", "{{thread_name}}")],
            width=12, steps=((None, "green"), (0.9, "orange"))),
        _timeseries(
            "CPU by mode per process",
            "user, system and iowait of each process. A data-loader worker in iowait waits "
            "on storage; one in system time fights for the CPU.",
            "short",
            [(f"sum by (pid, mode) ({CPU_RATE}{{{PROCESS}}})", "{{pid}} {{mode}}")],
            width=12, axis_label="cores"),
        _timeseries(
            "System share per process",
            "Kernel share of each process's CPU. Above 20% amber, 40% red: this process's "
            "threads oversubscribe the cores.",
            "percentunit",
            [(f"sum by (pid) ({CPU_RATE}{{{PROCESS_SYSTEM}}}) / sum by (pid) "
              f"({CPU_RATE}{{{PROCESS_BUSY}}})", "{{pid}}")],
            width=12, steps=SYSTEM_SHARE),
    ]


def _scheduling() -> list[Panel]:
    switches = "dlprof_process_context_switches_total"
    return [
        _timeseries(
            "Context switches",
            "involuntary: threads preempted because more are runnable than cores. "
            "voluntary: threads waiting on locks, I/O or sleeps; a jump here is lock "
            "contention or a starved queue.",
            "ops", [(f"sum by (kind) ({_rate(switches, PROCESS)})", "{{kind}}")], width=12),
        _timeseries(
            "Preemptions per CPU-second",
            "Involuntary switches per second of CPU each process uses: the "
            "oversubscription signal. Above 50 (amber) threads share cores; above 200 "
            "(red) cap OMP_NUM_THREADS and workers to the cores you have.",
            "short",
            [(f"sum by (pid) ({_rate(switches, INVOLUNTARY)}) "
              f"/ sum by (pid) ({_rate('dlprof_process_cpu_seconds_total', PROCESS_BUSY)})",
              "{{pid}}")],
            width=12, steps=PREEMPTIONS),
    ]


def _host() -> list[Panel]:
    return [
        _timeseries(
            "Host load vs cores",
            "Run-queue load against logical CPUs and physical cores. Load above the cores "
            "means runnable threads wait; above physical cores hyper-threads share units.",
            "short",
            [(f"max by (window) (dlprof_host_load_average{{{JOB}}})", "load {{window}}"),
             (f"sum by (kind) (dlprof_host_cpus{{{JOB}}})", "{{kind}} CPUs")],
            width=12),
        _timeseries(
            "Job share of busy host CPU",
            "The job's CPU over all busy CPU of its host. Below 50% (amber) other "
            "processes take the CPU: find them, or pin the job to its own cores.",
            "percentunit",
            [(f"sum by (instance) ({CPU_RATE}{{{PROCESS_BUSY}}}) / sum by (instance) ("
              + _rate("dlprof_host_cpu_seconds_total", JOB + ',mode!~"idle|iowait"', "1m")
              + ")", "{{instance}}")],
            width=12, steps=((None, "orange"), (0.5, "green"))),
    ]


def build_threads() -> dict[str, Any]:
    """Threads, CPU per thread group, scheduling and host load as a Grafana JSON model."""
    return _dashboard(
        "dlprof-threads", "dlprof-agent: threads and CPU",
        "Thread counts and names, CPU per thread group, context switches and host load: "
        "where oversubscription shows.",
        [("Summary", _thread_stats()), ("Threads", _threads()), ("CPU", _thread_cpu()),
         ("Scheduling", _scheduling()), ("Host", _host())], gpu=False)


# ---- GPU devices --------------------------------------------------------------------


def _device_stats() -> list[Panel]:
    return [
        _stat("NVML", "Whether the agent reads GPUs. 'no GPU' means no NVIDIA driver or "
              "the agent was installed without the `gpu` extra.",
              "short", f"min(dlprof_gpu_available{{{JOB}}})",
              mappings=_states(("0", "no GPU", "orange"), ("1", "reading", "green"))),
        _stat("GPUs", "Devices the agent sees on the selected hosts. Fewer than installed: check "
              "CUDA_VISIBLE_DEVICES and the container's device list.", "short",
              f"count(dlprof_gpu_info{{{DEVICE}}})"),
        _stat("GPUs lost", "Devices NVML can no longer read (fallen off the bus, Xid "
              "errors). Above 0 (red) check `nvidia-smi` and the kernel log.", "short",
              f"count(dlprof_gpu_up{{{DEVICE}}} == 0) or (0 * count(dlprof_gpu_up{{{DEVICE}}}))",
              steps=ANY_ERROR),
        _stat("Mean utilization", "Mean share of time a kernel ran. Red under 50%: the GPUs "
              "wait for the CPU or input.", "percentunit",
              f"avg(dlprof_gpu_utilization_ratio{{{DEVICE}}})", steps=GPU_BUSY),
        _stat("Fullest GPU memory", "Used share of the fullest GPU. Above 90% amber, 97% red: "
              "an allocation spike will fail.", "percentunit",
              f"max(dlprof_gpu_memory_used_bytes{{{DEVICE}}} / "
              f"dlprof_gpu_memory_total_bytes{{{DEVICE}}})",
              steps=((None, "green"), (0.9, "orange"), (0.97, "red"))),
        _stat("Hottest GPU", "Highest die temperature. Above 80 °C amber, 90 °C red: "
              "clocks drop soon; check cooling.", "celsius",
              f"max(dlprof_gpu_temperature_celsius{{{DEVICE}}})", steps=TEMPERATURE),
    ]



def _device_load() -> list[Panel]:
    return [
        _gpu_utilization(12),
        _timeseries(
            "Memory-controller utilization",
            "Share of time device memory was read or written. Above 80% (amber) with "
            "full kernel time the model is memory-bound: lower precision or fuse ops.",
            "percentunit", [(f"dlprof_gpu_memory_utilization_ratio{{{DEVICE}}}", GPU_LEGEND)],
            width=12, steps=((None, "green"), (0.8, "orange"))),
        _gpu_memory(12),
        _timeseries(
            "GPU memory used share",
            "Used over total per GPU. Above 90% (amber) the caching allocator has little "
            "room; above 97% (red) expect out-of-memory errors.",
            "percentunit",
            [(f"dlprof_gpu_memory_used_bytes{{{DEVICE}}} / dlprof_gpu_memory_total_bytes"
              f"{{{DEVICE}}}", GPU_LEGEND)],
            width=12, steps=((None, "green"), (0.9, "orange"), (0.97, "red"))),
    ]


def _device_health() -> list[Panel]:
    pcie = "dlprof_gpu_pcie_throughput_bytes_per_second"
    return [
        _timeseries(
            "PCIe throughput",
            "RX is host to device, TX device to host. Sustained RX during steps means "
            "data is copied every step: pin memory, prefetch, or keep it on the GPU.",
            "Bps",
            [(f'{pcie}{{{DEVICE},direction="rx"}}', f"{GPU_LEGEND} RX"),
             (f'{pcie}{{{DEVICE},direction="tx"}}', f"{GPU_LEGEND} TX")],
            width=12),
        _timeseries(
            "Power",
            "Draw against the enforced limit. Draw pinned at the limit means the GPU is "
            "power capped; see the throttle reasons.",
            "watt",
            [(f"dlprof_gpu_power_watts{{{DEVICE}}}", f"{GPU_LEGEND} draw"),
             (f"dlprof_gpu_power_limit_watts{{{DEVICE}}}", f"{GPU_LEGEND} limit")],
            width=12),
        _timeseries(
            "Clocks",
            "SM and memory clocks. Clocks dropping under load mean power or thermal "
            "throttling: check power and temperature.",
            "hertz", [(f"dlprof_gpu_clock_hertz{{{DEVICE}}}", f"{GPU_LEGEND} {{{{clock}}}}")]),
        _timeseries(
            "Throttle reasons",
            "Each line is a reason holding the clocks down. sw_power_cap under full load "
            "is common; hw_slowdown or thermal reasons point to cooling or power supply.",
            "short",
            [(f"dlprof_gpu_throttle_reason_active{{{DEVICE}}} > 0",
              f"{GPU_LEGEND} {{{{reason}}}}")]),
        _timeseries(
            "Temperature",
            "Die temperature. Above 80 °C (amber) throttling is near; above 90 °C (red) "
            "check airflow and fans.",
            "celsius", [(f"dlprof_gpu_temperature_celsius{{{DEVICE}}}", GPU_LEGEND)],
            steps=TEMPERATURE),
    ]


def _device_processes() -> list[Panel]:
    return [
        _process_gpu_memory(8),
        _timeseries(
            "SM share per process",
            "Each process's share of time with a kernel on the SMs. Processes sharing a "
            "GPU compete for it; low (red) for the training process means it waits.",
            "percentunit",
            [(f"sum by (pid, gpu) (dlprof_process_gpu_sm_utilization_ratio{{{PROCESS_DEVICE}}})",
              "pid {{pid}} GPU {{gpu}}")],
            steps=GPU_BUSY),
        _timeseries(
            "Memory-controller share per process",
            "Each process's share of time reading or writing device memory. High with a "
            "low SM share means the process is memory-bound.",
            "percentunit",
            [("sum by (pid, gpu) (dlprof_process_gpu_memory_utilization_ratio"
              f"{{{PROCESS_DEVICE}}})", "pid {{pid}} GPU {{gpu}}")],
            steps=((None, "green"), (0.8, "orange"))),
    ]


def build_gpu() -> dict[str, Any]:
    """Per-GPU utilization, memory, PCIe, power, clocks and temperature as a JSON model."""
    return _dashboard(
        "dlprof-gpu", "dlprof-agent: GPU devices",
        "Each GPU's utilization, memory, PCIe, power, clocks and temperature, and each "
        "process's share of it, from NVML.",
        [("Devices", _device_stats()), ("Load and memory", _device_load()),
         ("PCIe, power and clocks", _device_health()), ("Processes", _device_processes())],
        gpu=True)


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


def _dashboard(uid: str, title: str, description: str,
               rows: Sequence[tuple[str, Sequence[Panel]]], *, gpu: bool) -> dict[str, Any]:
    ids = itertools.count(1)
    # The other dashboards, one click away, with the same variables and time range.
    others = (dashboard_builders.DashboardLink("dlprof-agent")
              .type(dashboard_models.DashboardLinkType.DASHBOARDS).tags(["dlprof-agent"])
              .as_dropdown(True).include_vars(True).keep_time(True))
    builder = (dashboard_builders.Dashboard(title).uid(uid).description(description)
               .tags(["dlprof-agent"]).links([others])
               .time("now-30m", "now").refresh("10s")
               .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
               .variables(_variables(gpu=gpu)))
    for row_title, row_panels in rows:
        builder = builder.with_row(dashboard_builders.Row(row_title).id(next(ids)))
        for panel in row_panels:
            builder = builder.with_panel(panel.id(next(ids)))
    model: dict[str, Any] = json.loads(json.dumps(builder.build(), cls=JSONEncoder))
    return model


def dashboards() -> dict[str, dict[str, Any]]:
    """Every shipped dashboard by its file name."""
    return {"overview.json": build_overview(), "layers.json": build_layers(),
            "threads.json": build_threads(), "gpu.json": build_gpu()}


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
