"""The overview dashboard: where the job's time goes, at a glance."""

from __future__ import annotations

from typing import Any

from grafana_foundation_sdk.builders import stat
from grafana_foundation_sdk.models import common

from dlprof_agent.exporters.prometheus_rules import CPU_RATE, LAYER_RATE, STEP_MEAN, THREAD_CPU_RATE
from dlprof_agent.grafana.gpu import gpu_memory, gpu_utilization, process_gpu_memory
from dlprof_agent.grafana.panels import (
    ANY_ERROR,
    DEVICE,
    GPU_BUSY,
    HOST_BUSY,
    JOB,
    PROCESS,
    PROCESS_BUSY,
    PROCESS_DEVICE,
    PROCESS_SYSTEM,
    RUN_QUEUE,
    STEADY,
    SYSTEM_SHARE,
    Panel,
    dashboard,
    rate,
    stat_panel,
    table_panel,
    time_series,
    value_states,
)
from dlprof_agent.model.findings.catalogue import KINDS

# ---- Overview: where the time goes --------------------------------------------------


def _findings() -> stat.Panel:
    """One tile per finding the agent judged for the selected processes."""
    catalogue = "\n".join(f"- **{kind.id}** ({kind.severity}): {kind.summary}. Try: "
                           f"{kind.advice}." for kind in KINDS)
    return (stat_panel(
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
        mappings=value_states(("0", "clear", "green"), ("1", "holds", "red")))
        .text_mode(common.BigValueTextMode.VALUE_AND_NAME)
        .graph_mode(common.BigValueGraphMode.NONE))


def _overview_stats() -> list[Panel]:
    return [
        _findings(),
        stat_panel("Target up",
                   "1 while the attached process runs, 0 once it exited. No value: Prometheus "
                   "does not scrape the agent; check the scrape targets page.",
                   "short", f"min(dlprof_target_up{{{JOB}}})",
                   mappings=value_states(("0", "exited", "red"), ("1", "up", "green"))),
        stat_panel("Probe",
                   "Whether the agent reads the probe inside the job. Without it there is no step "
                   "time, samples/s or layers: start the job with `dlprof-agent run`, or see the "
                   "agent's log for why injection was refused.",
                   "short", f"min(dlprof_probe_up{{{PROCESS}}})",
                   mappings=value_states(("0", "none", "orange"), ("1", "reading", "green"))),
        stat_panel("Samples per second",
                   "Training throughput over steady-state steps, all selected processes. The "
                   "number to compare between runs; a drop with a busy CPU points to input or "
                   "oversubscription.",
                   "short",
                   f"sum({rate('dlprof_samples_total', STEADY)})"),
        stat_panel("Mean step time",
                   "Steady-state step time over the last minute, averaged over processes. "
                   "Compare with the phases below to see where it goes.",
                   "s", f"avg({STEP_MEAN}{{{PROCESS}}})"),
        stat_panel("CPU cores used",
                   "Cores the job keeps busy (user + system). Near the host's core count means "
                   "the CPU, not the GPU, sets the pace.",
                   "short", f"sum({CPU_RATE}{{{PROCESS_BUSY}}})"),
        stat_panel("System share of CPU",
                   "Share of the job's CPU spent in the kernel. Above 20% is suspicious, above 40% "
                   "is oversubscription: lower the thread counts (OMP_NUM_THREADS, intra-op "
                   "threads, data-loader workers).",
                   "percentunit",
                   f"sum({CPU_RATE}{{{PROCESS_SYSTEM}}}) / sum({CPU_RATE}{{{PROCESS_BUSY}}})",
                   steps=SYSTEM_SHARE),
        stat_panel("Resident memory",
                   "Resident memory of the selected processes together; growth that never levels "
                   "off is a leak.",
                   "bytes", f"sum(dlprof_process_resident_memory_bytes{{{PROCESS}}})"),
        stat_panel("Largest resident peak",
                   "The highest resident memory any selected process reached since the agent "
                   "attached, spikes between samples included. Size memory limits by this.",
                   "bytes", f"max(dlprof_process_resident_memory_peak_bytes{{{PROCESS}}})"),
        stat_panel("Threads",
                   "Threads of the selected processes. Many more busy threads than cores "
                   "means oversubscription: watch the system share.",
                   "short", f"sum(dlprof_process_threads{{{PROCESS}}})"),
        stat_panel("Run queue per core",
                   "1-minute load over logical CPUs of the busiest host. Above 1 threads wait for "
                   "a CPU: fewer threads or workers, or a bigger machine.",
                   "short",
                   f'max(dlprof_host_load_average{{{JOB},window="1m"}} / ignoring(window, kind) '
                   f'dlprof_host_cpus{{{JOB},kind="logical"}})', steps=RUN_QUEUE),
        stat_panel("GPU utilization",
                   "Mean share of time a kernel ran on the selected GPUs. Low (red) while the CPU "
                   "is busy means the GPU waits for input: more loader workers, pinned memory, "
                   "larger batches.",
                   "percentunit", f"avg(dlprof_gpu_utilization_ratio{{{DEVICE}}})", steps=GPU_BUSY),
        stat_panel("GPU memory of the job",
                   "Device memory the selected processes hold on the selected GPUs. Far below the "
                   "GPU's memory leaves room for a larger batch.",
                   "bytes", f"sum(dlprof_process_gpu_memory_bytes{{{PROCESS_DEVICE}}})"),
    ]


def _training() -> list[Panel]:
    return [
        time_series(
            "Step time",
            "Mean step time per process over the last minute, and the 90th percentile of "
            "all steps. A p90 far above the mean means some steps stall: look for "
            "periodic work (checkpoints, evaluation, garbage collection).",
            "s",
            [(f"max by (pid) ({STEP_MEAN}{{{PROCESS}}})", "{{pid}} mean"),
             ("histogram_quantile(0.9, sum by (le) ("
              + rate("dlprof_step_duration_seconds_bucket", PROCESS) + "))", "p90")]),
        time_series(
            "Samples per second",
            "Steady-state throughput per process. The figure of merit: a change you make "
            "should raise this, not just the GPU utilization.",
            "short", [(f"sum by (pid) ({rate('dlprof_samples_total', STEADY)})", "{{pid}}")],
            axis_label="samples/s"),
        time_series(
            "Warm-up and steady steps",
            "Steps counted since the agent attached. Warm-up steps (compilation, autotuning, "
            "allocator growth) are left out of the step time; a steady line that stops "
            "rising while the job runs means it hangs.",
            "short", [(f"sum by (phase) (dlprof_steps_total{{{PROCESS}}})", "{{phase}}")]),
        time_series(
            "Step time by phase",
            "Share of step time in forward, backward, optimizer and other. A large 'other' "
            "is time no hook sees, usually data loading: more workers, prefetching, or a "
            "faster input format.",
            "percentunit",
            [(f"sum by (phase) ({rate('dlprof_step_phase_seconds_total', PROCESS)}) "
              f"/ ignoring(phase) group_left "
              f"sum({rate('dlprof_step_duration_seconds_sum', PROCESS)})", "{{phase}}")],
            width=12, stacked=True),
        time_series(
            "Top layers",
            "The ten layers with the most CPU time (forward + backward) per process, as a "
            "share of wall time, over the last minute. Start optimising at the top; the "
            "layers dashboard splits the phases.",
            "percentunit",
            [(f"topk(10, avg by (layer) ({LAYER_RATE}{{{PROCESS}}}))", "{{layer}}")],
            width=12),
        table_panel(
            "Framework settings",
            "The settings the job's training thread runs with. Thread counts above the "
            "cores you give the job oversubscribe the CPU; cudnn_autotune off or fp32 "
            "precision on a GPU leave speed on the table.",
            f"dlprof_framework_info{{{PROCESS}}}",
            ["Time", "Value", "__name__", "job"]),
    ]


def _cpu() -> list[Panel]:
    return [
        time_series(
            "CPU by mode",
            "user is your code and libraries, system the kernel working for it; iowait "
            "is time blocked on disk reads, not CPU use. iowait rising means the input "
            "pipeline waits on storage: cache or prefetch the data set.",
            "short", [(f"sum by (mode) ({CPU_RATE}{{{PROCESS}}})", "{{mode}}")],
            axis_label="cores"),
        time_series(
            "System share of CPU",
            "System time rising with thread count means oversubscription: more threads "
            "than cores, and the kernel busy switching between them. Above 20% (amber) "
            "lower the thread counts; above 40% (red) they cost throughput.",
            "percentunit",
            [(f"sum({CPU_RATE}{{{PROCESS_SYSTEM}}}) / sum({CPU_RATE}{{{PROCESS_BUSY}}})",
              "system share")], steps=SYSTEM_SHARE),
        time_series(
            "Context switches",
            "involuntary: threads preempted, more runnable threads than cores: reduce "
            "threads. voluntary: threads waiting on locks, I/O or sleeps.",
            "ops",
            [(f"sum by (kind) ({rate('dlprof_process_context_switches_total', PROCESS)})",
              "{{kind}}")]),
        time_series(
            "CPU by thread group",
            "Which threads burn the CPU (data loaders, the Python main thread, OpenMP or "
            "NCCL pools). One group pinned near 1 core while the GPU idles is a "
            "single-thread or GIL bottleneck: move work to worker processes.",
            "short",
            [(f'sum by (thread_name) ({THREAD_CPU_RATE}{{{PROCESS},mode!="iowait"}})',
              "{{thread_name}}")],
            width=12, stacked=True, axis_label="cores"),
        time_series(
            "Host CPU by mode",
            "Busy cores of the whole host against its logical CPUs. A busy host with a "
            "quiet job means neighbours compete for CPU; steal means the hypervisor does.",
            "short",
            [(f"sum by (mode) ({rate('dlprof_host_cpu_seconds_total', HOST_BUSY)})",
              "{{mode}}"),
             (f'sum(dlprof_host_cpus{{{JOB},kind="logical"}})', "logical CPUs")],
            width=12, axis_label="cores"),
    ]


def _memory() -> list[Panel]:
    return [
        time_series(
            "Resident memory per process",
            "Peak above resident means spikes between samples: size memory limits by the "
            "peak. Steady growth is a leak or an unbounded cache.",
            "bytes",
            [(f"max by (pid) (dlprof_process_resident_memory_bytes{{{PROCESS}}})",
              "{{pid}} resident"),
             (f"max by (pid) (dlprof_process_resident_memory_peak_bytes{{{PROCESS}}})",
              "{{pid}} peak")]),
        time_series(
            "Host memory available",
            "Available falling toward zero squeezes the page cache; swapping or the OOM "
            "killer comes next. Fewer loader workers or a smaller shuffle buffer help.",
            "bytes",
            [(f"sum by (instance) (dlprof_host_memory_available_bytes{{{JOB}}})",
              "{{instance}} available"),
             (f"sum by (instance) (dlprof_host_memory_total_bytes{{{JOB}}})",
              "{{instance}} total")]),
        time_series(
            "Swap in/out",
            "Any sustained swap-in means the host is out of memory and steps stall on "
            "disk; it shows as iowait too. Free memory before tuning anything else.",
            "Bps",
            [(f"sum by (direction) ({rate('dlprof_host_swap_io_bytes_total', JOB)})",
              "{{direction}}")]),
    ]


def _io() -> list[Panel]:
    return [
        time_series(
            "Storage I/O",
            "Bytes that reached the storage device. High reads together with iowait mean "
            "the input pipeline is bound by the disk: cache, shard or prefetch.",
            "Bps",
            [(f"sum by (direction) ({rate('dlprof_process_io_bytes_total', PROCESS)})",
              "{{direction}}")],
            width=12),
        time_series(
            "Logical I/O",
            "Bytes through read and write calls, page-cache hits included. Far above "
            "storage I/O means the page cache serves the data set, as it should.",
            "Bps",
            [(f"sum by (direction) ({rate('dlprof_process_io_logical_bytes_total', PROCESS)})",
              "{{direction}}")],
            width=12),
    ]


def _gpu_summary() -> list[Panel]:
    return [gpu_utilization(8), gpu_memory(8), process_gpu_memory(8)]


def _agent() -> list[Panel]:
    return [
        time_series(
            "Agent sample duration",
            "Time one sampling pass takes. Close to the interval means the agent falls "
            "behind and samples age: raise --interval or drop --layers.",
            "s",
            [(f"dlprof_agent_sample_duration_seconds{{{JOB}}}", "{{instance}} duration"),
             (f"dlprof_agent_interval_seconds{{{JOB}}}", "{{instance}} interval")]),
        time_series(
            "Agent CPU",
            "CPU the agent itself uses, as a share of one core. Above 10% (amber) raise "
            "--interval; the agent should never compete with the job.",
            "percentunit", [(rate("dlprof_agent_cpu_seconds_total", JOB), "{{instance}}")],
            steps=((None, "green"), (0.1, "orange"), (0.25, "red"))),
        time_series(
            "Collector errors",
            "Failed reads in the last 5 minutes by collector; anything above 0 (red) is "
            "logged once by the agent, so check its log.",
            "short",
            [(f"sum by (collector) (increase(dlprof_collector_errors_total{{{JOB}}}[5m]))",
              "{{collector}}")], steps=ANY_ERROR),
    ]


def build_overview() -> dict[str, Any]:
    """The "where the time goes" dashboard as a Grafana JSON model."""
    return dashboard(
        "dlprof-overview", "dlprof-agent: where the time goes",
        "Step time, throughput, CPU, memory, I/O and GPU of a training job, from "
        "dlprof-agent.",
        [("Overview", _overview_stats()), ("Training", _training()), ("CPU", _cpu()),
         ("Memory", _memory()), ("I/O", _io()), ("GPU", _gpu_summary()),
         ("Agent", _agent())], gpu=True)
