"""The metric families of the process tree, the host, the GPUs, the agent and the
findings, built from one snapshot's samples. Names and labels here are the
contract documented in docs/metrics.md."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)

from dlprof_agent import __version__
from dlprof_agent.collectors.gpu_samples import GpuSample
from dlprof_agent.collectors.host import HostSample
from dlprof_agent.collectors.identity import Identity, info_labels
from dlprof_agent.collectors.process import ProcessSample
from dlprof_agent.model.findings.catalogue import Finding
from dlprof_agent.model.snapshot import NodeSnapshot, Snapshot

CPU_MODES = ("user", "system", "iowait")
# After pid on the per-target step, phase and finding families (docs/fleet-identity.md).
JOB_LABELS = ("job_id", "rank")
# dlprof_target_info's labels after pid.
TARGET_INFO_LABELS = tuple(info_labels(Identity()))
LOAD_WINDOWS = ("1m", "5m", "15m")


def gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def counter(name: str, doc: str, labels: Iterable[str] = ()) -> CounterMetricFamily:
    # prometheus_client appends _total itself; the contract names carry it.
    return CounterMetricFamily(name.removesuffix("_total"), doc, labels=list(labels))


def process_families(processes: Iterable[ProcessSample]) -> list[Metric]:
    info = gauge("dlprof_process_info",
                 "Processes the agent reads: the target and its descendants.",
                 ["pid", "ppid", "name", "role"])
    cpu = counter("dlprof_process_cpu_seconds_total",
                  "CPU seconds by mode; iowait is time blocked on block I/O.", ["pid", "mode"])
    rss = gauge("dlprof_process_resident_memory_bytes", "Resident memory.", ["pid"])
    rss_peak = gauge("dlprof_process_resident_memory_peak_bytes",
                     "Highest resident memory since the agent attached.", ["pid"])
    vms = gauge("dlprof_process_virtual_memory_bytes", "Virtual memory size.", ["pid"])
    threads = gauge("dlprof_process_threads", "Threads in the process.", ["pid"])
    group_cpu = counter("dlprof_thread_group_cpu_seconds_total",
                        "CPU seconds of the threads sharing a name, by mode.",
                        ["pid", "thread_name", "mode"])
    group_threads = gauge("dlprof_thread_group_threads",
                          "Live threads sharing a name.", ["pid", "thread_name"])
    switches = counter("dlprof_process_context_switches_total",
                       "Context switches: voluntary (waits) and involuntary (preempted).",
                       ["pid", "kind"])
    io = counter("dlprof_process_io_bytes_total",
                 "Bytes read from and written to storage.", ["pid", "direction"])
    io_logical = counter("dlprof_process_io_logical_bytes_total",
                         "Bytes passed through read and write system calls, "
                         "page-cache hits included.", ["pid", "direction"])
    fds = gauge("dlprof_process_open_fds", "Open file descriptors.", ["pid"])
    main_wait = counter("dlprof_process_main_thread_run_queue_wait_seconds_total",
                        "Time the main thread was runnable but waited in a run queue for "
                        "a CPU (the kernel's schedstat): its share of the main thread's "
                        "runnable time is CPU it was denied.", ["pid"])
    main_run = counter("dlprof_process_main_thread_run_seconds_total",
                       "Time the main thread ran on a CPU (the kernel's schedstat).", ["pid"])
    start = gauge("dlprof_process_start_time_seconds",
                  "Process start, in seconds since the Unix epoch.", ["pid"])

    for p in processes:
        pid = str(p.pid)
        info.add_metric([pid, str(p.ppid), p.name, "target" if p.is_target else "child"], 1)
        for mode, seconds in zip(CPU_MODES, (p.user_seconds, p.system_seconds,
                                             p.iowait_seconds), strict=True):
            cpu.add_metric([pid, mode], seconds)
        rss.add_metric([pid], p.rss_bytes)
        rss_peak.add_metric([pid], p.rss_peak_bytes)
        vms.add_metric([pid], p.vms_bytes)
        threads.add_metric([pid], p.threads)
        for group in p.thread_groups:
            group_threads.add_metric([pid, group.name], group.threads)
            for mode, seconds in zip(CPU_MODES, (group.user_seconds, group.system_seconds,
                                                 group.iowait_seconds), strict=True):
                group_cpu.add_metric([pid, group.name, mode], seconds)
        switches.add_metric([pid, "voluntary"], p.voluntary_context_switches)
        switches.add_metric([pid, "involuntary"], p.involuntary_context_switches)
        for family, read, write in ((io, p.read_bytes, p.write_bytes),
                                    (io_logical, p.read_chars, p.write_chars)):
            if read is not None and write is not None:
                family.add_metric([pid, "read"], read)
                family.add_metric([pid, "write"], write)
        if p.open_fds is not None:
            fds.add_metric([pid], p.open_fds)
        if p.main_thread_wait_seconds is not None and p.main_thread_run_seconds is not None:
            main_wait.add_metric([pid], p.main_thread_wait_seconds)
            main_run.add_metric([pid], p.main_thread_run_seconds)
        start.add_metric([pid], p.start_time_seconds)
    return [info, cpu, rss, rss_peak, vms, threads, group_cpu, group_threads, switches, io,
            io_logical, fds, main_wait, main_run, start]


def host_families(host: HostSample) -> list[Metric]:
    cpu = counter("dlprof_host_cpu_seconds_total", "Host CPU seconds by mode, all CPUs.",
                  ["mode"])
    for mode, seconds in host.cpu_seconds:
        cpu.add_metric([mode], seconds)
    cpus = gauge("dlprof_host_cpus", "CPUs: logical (hardware threads) and physical cores.",
                 ["kind"])
    cpus.add_metric(["logical"], host.logical_cpus)
    if host.physical_cpus is not None:
        cpus.add_metric(["physical"], host.physical_cpus)
    memory_total = gauge("dlprof_host_memory_total_bytes", "Host memory.")
    memory_total.add_metric([], host.memory_total_bytes)
    memory_available = gauge("dlprof_host_memory_available_bytes",
                             "Memory available to start new work without swapping.")
    memory_available.add_metric([], host.memory_available_bytes)
    swap_total = gauge("dlprof_host_swap_total_bytes", "Swap space.")
    swap_total.add_metric([], host.swap_total_bytes)
    swap_used = gauge("dlprof_host_swap_used_bytes", "Swap space in use.")
    swap_used.add_metric([], host.swap_used_bytes)
    swap_io = counter("dlprof_host_swap_io_bytes_total",
                      "Bytes swapped in from and out to disk since boot.", ["direction"])
    swap_io.add_metric(["in"], host.swap_in_bytes)
    swap_io.add_metric(["out"], host.swap_out_bytes)
    load = gauge("dlprof_host_load_average", "Run-queue load average.", ["window"])
    for window, value in zip(LOAD_WINDOWS, host.load_average, strict=True):
        load.add_metric([window], value)
    return [cpu, cpus, memory_total, memory_available, swap_total, swap_used, swap_io, load]


def gpu_families(gpu: GpuSample | None) -> list[Metric]:
    available = gauge("dlprof_gpu_available",
                      "1 when NVML is loaded and sees at least one GPU, else 0.")
    available.add_metric([], 1 if gpu is not None and gpu.available else 0)
    if gpu is None or not gpu.available:
        return [available]

    device_labels = ["gpu", "uuid"]
    info = gauge("dlprof_gpu_info", "GPU model and driver.",
                 [*device_labels, "name", "driver_version"])
    up = gauge("dlprof_gpu_up", "1 while NVML can read the GPU, 0 once it is lost.",
               device_labels)
    # (family, attribute of GpuDeviceSample); a None reading adds no series.
    per_device: list[tuple[GaugeMetricFamily | CounterMetricFamily, str]] = [
        (gauge("dlprof_gpu_utilization_ratio",
               "Share of time a kernel was running on the GPU.", device_labels),
         "utilization_ratio"),
        (gauge("dlprof_gpu_memory_utilization_ratio",
               "Share of time device memory was being read or written.", device_labels),
         "memory_utilization_ratio"),
        (gauge("dlprof_gpu_memory_used_bytes", "Device memory in use.", device_labels),
         "memory_used_bytes"),
        (gauge("dlprof_gpu_memory_total_bytes", "Device memory.", device_labels),
         "memory_total_bytes"),
        (gauge("dlprof_gpu_power_watts", "Power draw.", device_labels), "power_watts"),
        (gauge("dlprof_gpu_power_limit_watts", "Enforced power limit.", device_labels),
         "power_limit_watts"),
        (counter("dlprof_gpu_energy_joules_total",
                 "Energy used since the driver was loaded.", device_labels),
         "energy_joules"),
        (gauge("dlprof_gpu_temperature_celsius", "GPU die temperature.", device_labels),
         "temperature_celsius"),
    ]
    pcie = gauge("dlprof_gpu_pcie_throughput_bytes_per_second",
                 "PCIe throughput over NVML's last 20 ms window; tx is GPU to host.",
                 [*device_labels, "direction"])
    clock = gauge("dlprof_gpu_clock_hertz", "Current clock frequency.",
                  [*device_labels, "clock"])
    throttle = gauge("dlprof_gpu_throttle_reason_active",
                     "1 while the given reason holds the clocks down.",
                     [*device_labels, "reason"])

    for device in gpu.devices:
        labels = [str(device.index), device.uuid]
        info.add_metric([*labels, device.name, gpu.driver_version or ""], 1)
        up.add_metric(labels, 1 if device.up else 0)
        for family, attribute in per_device:
            value = getattr(device, attribute)
            if value is not None:
                family.add_metric(labels, value)
        for direction, value in (("tx", device.pcie_tx_bytes_per_second),
                                 ("rx", device.pcie_rx_bytes_per_second)):
            if value is not None:
                pcie.add_metric([*labels, direction], value)
        for name, value in (("sm", device.sm_clock_hertz),
                            ("memory", device.memory_clock_hertz)):
            if value is not None:
                clock.add_metric([*labels, name], value)
        for reason, active in device.throttle_reasons or ():
            throttle.add_metric([*labels, reason], 1 if active else 0)

    process_labels = ["pid", "gpu"]
    process_memory = gauge("dlprof_process_gpu_memory_bytes",
                           "GPU memory the process holds on the device.", process_labels)
    process_sm = gauge("dlprof_process_gpu_sm_utilization_ratio",
                       "Share of time the process had a kernel on the device's SMs.",
                       process_labels)
    process_memory_util = gauge("dlprof_process_gpu_memory_utilization_ratio",
                                "Share of time the process was reading or writing "
                                "device memory.", process_labels)
    for process in gpu.processes:
        labels = [str(process.pid), str(process.gpu_index)]
        for family, value in ((process_memory, process.memory_bytes),
                              (process_sm, process.sm_utilization_ratio),
                              (process_memory_util, process.memory_utilization_ratio)):
            if value is not None:
                family.add_metric(labels, value)
    return [available, info, up, *(family for family, _ in per_device), pcie, clock,
            throttle, process_memory, process_sm, process_memory_util]


def agent_families(snapshot: Snapshot | NodeSnapshot | None, interval_seconds: float
                   ) -> list[Metric]:
    info = gauge("dlprof_agent_info", "The agent's version.", ["version"])
    info.add_metric([__version__], 1)
    interval = gauge("dlprof_agent_interval_seconds", "Time between sampling passes.")
    interval.add_metric([], interval_seconds)
    errors = counter("dlprof_collector_errors_total",
                     "Failed reads per collector; each distinct failure is logged once.",
                     ["collector"])
    families: list[Metric] = [info, interval, errors]
    if snapshot is None:
        return families
    for collector, count in snapshot.collector_errors:
        errors.add_metric([collector], count)
    if snapshot.series_dropped:
        dropped = counter("dlprof_agent_series_dropped_total",
                          "Series the agent's budgets left out (folded into other rows), "
                          "summed over sampling passes, by the budget that did.", ["reason"])
        for reason, count in snapshot.series_dropped:
            dropped.add_metric([reason], count)
        families.append(dropped)
    samples = counter("dlprof_agent_samples_total", "Sampling passes so far.")
    samples.add_metric([], snapshot.samples_total)
    duration = gauge("dlprof_agent_sample_duration_seconds",
                     "How long the last sampling pass took.")
    duration.add_metric([], snapshot.sample_duration_seconds)
    last = gauge("dlprof_agent_last_sample_timestamp_seconds",
                 "When the last sampling pass started, in seconds since the Unix epoch.")
    last.add_metric([], snapshot.timestamp_seconds)
    families += [samples, duration, last]
    if snapshot.agent is not None:
        cpu = counter("dlprof_agent_cpu_seconds_total", "The agent's own CPU seconds.")
        cpu.add_metric([], snapshot.agent.cpu_seconds)
        rss = gauge("dlprof_agent_resident_memory_bytes", "The agent's own resident memory.")
        rss.add_metric([], snapshot.agent.rss_bytes)
        peak = gauge("dlprof_agent_resident_memory_peak_bytes",
                     "The agent's own highest resident memory.")
        peak.add_metric([], snapshot.agent.rss_peak_bytes)
        families += [cpu, rss, peak]
    return families


def target_families(snapshot: Snapshot) -> list[Metric]:
    target_up = gauge("dlprof_target_up",
                      "1 while the attached process runs, 0 once it has exited.", ["pid"])
    pid = str(snapshot.target_pid)
    target_up.add_metric([pid], 1 if snapshot.target_up else 0)
    identity = snapshot.identity
    if identity is None:
        return [target_up]
    info = gauge("dlprof_target_info",
                 "1, with who the target is: its job, rank, node, pod and container, and "
                 "its role (rank, launcher of ranks, or a process of its own); "
                 "docs/fleet-identity.md says where each comes from.",
                 ["pid", *TARGET_INFO_LABELS])
    info.add_metric([pid, *info_labels(identity).values()], 1)
    families: list[Metric] = [target_up, info]
    if identity.world_size is not None:
        world = gauge("dlprof_target_world_size",
                      "Ranks in the target's job, as its launcher or its process group "
                      "says; compare with the ranks reporting.", ["pid", *JOB_LABELS])
        world.add_metric([pid, identity.job_id, identity.rank], identity.world_size)
        families.append(world)
    return families


def finding_families(target_pid: int, findings: Iterable[Finding],
                     identity: Identity | None = None) -> list[Metric]:
    """Every rule that could judge the target: 1 while its finding is raised, else 0
    (absent: nothing to judge, e.g. no probe or no GPU)."""
    findings = list(findings)
    if not findings:
        return []
    job = [str(target_pid), *(("", "") if identity is None
                              else (identity.job_id, identity.rank))]
    state = gauge("dlprof_finding",
                  "1 while a finding about the job holds, 0 while its rule sees no cause; "
                  "docs/findings.md explains each.", ["pid", *JOB_LABELS, "finding", "severity"])
    evidence = gauge("dlprof_finding_evidence",
                     "The figures each finding's rule judged, over its last window; the "
                     "quantity's name ends in its unit.",
                     ["pid", *JOB_LABELS, "finding", "quantity"])
    for finding in findings:
        state.add_metric([*job, finding.id, finding.severity], 1 if finding.active else 0)
        for quantity, value in finding.evidence:
            evidence.add_metric([*job, finding.id, quantity], value)
    return [state, evidence]
