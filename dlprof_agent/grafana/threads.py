"""The threads and CPU dashboard: thread groups, scheduling, the host."""

from __future__ import annotations

from typing import Any

from dlprof_agent.exporters.prometheus_rules import CPU_RATE, THREAD_CPU_RATE
from dlprof_agent.grafana.panels import (
    INVOLUNTARY,
    JOB,
    PREEMPTIONS,
    PROCESS,
    PROCESS_BUSY,
    PROCESS_SYSTEM,
    RUN_QUEUE,
    SYSTEM_SHARE,
    Panel,
    dashboard,
    rate,
    stat_panel,
    time_series,
)

# ---- Threads and CPU ----------------------------------------------------------------


def _thread_stats() -> list[Panel]:
    switches = rate("dlprof_process_context_switches_total", INVOLUNTARY)
    cpu = rate("dlprof_process_cpu_seconds_total", PROCESS_BUSY)
    return [
        stat_panel("Threads", "Threads of the selected processes now. Compare the busy ones, "
                   "below, with the cores.",
                   "short", f"sum(dlprof_process_threads{{{PROCESS}}})"),
        stat_panel("Host logical CPUs", "Hardware threads of the host(s). Busy threads beyond "
                   "this number wait for a CPU.",
                   "short", f'sum(dlprof_host_cpus{{{JOB},kind="logical"}})'),
        stat_panel("CPU cores used", "Cores the job keeps busy (user + system), last minute. "
                   "Near the logical CPUs means the job is CPU-bound: see which thread group "
                   "below.",
                   "short", f"sum({CPU_RATE}{{{PROCESS_BUSY}}})"),
        stat_panel("System share of CPU", "Kernel share of the job's CPU. Above 20% amber, 40% "
                   "red: oversubscription; lower the thread counts.",
                   "percentunit",
                   f"sum({CPU_RATE}{{{PROCESS_SYSTEM}}}) / sum({CPU_RATE}{{{PROCESS_BUSY}}})",
                   steps=SYSTEM_SHARE),
        stat_panel("Preemptions per CPU-second", "Involuntary context switches per second of "
                   "CPU used. Above 50 (amber) threads share cores; above 200 (red) they fight "
                   "for them: fewer threads.",
                   "short", f"sum({switches}) / sum({cpu})", steps=PREEMPTIONS),
        stat_panel("Run queue per core", "1-minute load over logical CPUs. Above 1 runnable "
                   "threads wait for a CPU.",
                   "short",
                   f'max(dlprof_host_load_average{{{JOB},window="1m"}} / ignoring(window, kind) '
                   f'dlprof_host_cpus{{{JOB},kind="logical"}})', steps=RUN_QUEUE),
    ]


def _threads() -> list[Panel]:
    return [
        time_series(
            "Threads per process",
            "Live threads in each process. A count that keeps climbing is a thread leak; "
            "each data-loader worker is a process of its own here.",
            "short", [(f"sum by (pid) (dlprof_process_threads{{{PROCESS}}})", "{{pid}}")],
            width=12),
        time_series(
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
        time_series(
            "CPU by thread group",
            "Cores used by each thread name, last minute. The group that grows when the "
            "job slows is the bottleneck.",
            "short", [(f"sum by (thread_name) ({groups})", "{{thread_name}}")],
            width=12, stacked=True, axis_label="cores"),
        time_series(
            "CPU per thread",
            "A group's CPU over its thread count: how busy its average thread is. Near "
            "100% (amber) for the main thread is a single-thread or GIL bottleneck; low "
            "for a big pool means the pool is larger than the work.",
            "percentunit",
            [(f"sum by (thread_name) ({groups}) / sum by (thread_name) "
              f"(dlprof_thread_group_threads{{{PROCESS}}})", "{{thread_name}}")],
            width=12, steps=((None, "green"), (0.9, "orange"))),
        time_series(
            "CPU by mode per process",
            "user, system and iowait of each process. A data-loader worker in iowait waits "
            "on storage; one in system time fights for the CPU.",
            "short",
            [(f"sum by (pid, mode) ({CPU_RATE}{{{PROCESS}}})", "{{pid}} {{mode}}")],
            width=12, axis_label="cores"),
        time_series(
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
        time_series(
            "Context switches",
            "involuntary: threads preempted because more are runnable than cores. "
            "voluntary: threads waiting on locks, I/O or sleeps; a jump here is lock "
            "contention or a starved queue.",
            "ops", [(f"sum by (kind) ({rate(switches, PROCESS)})", "{{kind}}")], width=12),
        time_series(
            "Preemptions per CPU-second",
            "Involuntary switches per second of CPU each process uses: the "
            "oversubscription signal. Above 50 (amber) threads share cores; above 200 "
            "(red) cap OMP_NUM_THREADS and workers to the cores you have.",
            "short",
            [(f"sum by (pid) ({rate(switches, INVOLUNTARY)}) "
              f"/ sum by (pid) ({rate('dlprof_process_cpu_seconds_total', PROCESS_BUSY)})",
              "{{pid}}")],
            width=12, steps=PREEMPTIONS),
    ]


def _host() -> list[Panel]:
    return [
        time_series(
            "Host load vs cores",
            "Run-queue load against logical CPUs and physical cores. Load above the cores "
            "means runnable threads wait; above physical cores hyper-threads share units.",
            "short",
            [(f"max by (window) (dlprof_host_load_average{{{JOB}}})", "load {{window}}"),
             (f"sum by (kind) (dlprof_host_cpus{{{JOB}}})", "{{kind}} CPUs")],
            width=12),
        time_series(
            "Job share of busy host CPU",
            "The job's CPU over all busy CPU of its host. Below 50% (amber) other "
            "processes take the CPU: find them, or pin the job to its own cores.",
            "percentunit",
            [(f"sum by (instance) ({CPU_RATE}{{{PROCESS_BUSY}}}) / sum by (instance) ("
              + rate("dlprof_host_cpu_seconds_total", JOB + ',mode!~"idle|iowait"', "1m")
              + ")", "{{instance}}")],
            width=12, steps=((None, "orange"), (0.5, "green"))),
    ]


def build_threads() -> dict[str, Any]:
    """Threads, CPU per thread group, scheduling and host load as a Grafana JSON model."""
    return dashboard(
        "dlprof-threads", "dlprof-agent: threads and CPU",
        "Thread counts and names, CPU per thread group, context switches and host load: "
        "where oversubscription shows.",
        [("Summary", _thread_stats()), ("Threads", _threads()), ("CPU", _thread_cpu()),
         ("Scheduling", _scheduling()), ("Host", _host())], gpu=False)
