"""Renders the latest snapshot as Prometheus metric families.

Families are built fresh on every scrape, so the series of a process that has
exited simply disappear. A scrape never triggers sampling. Names and labels
here are the contract documented in docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Generic, TypeVar

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from dlprof_agent import __version__
from dlprof_agent.collectors.gpu_samples import GpuSample
from dlprof_agent.collectors.host import HostSample
from dlprof_agent.collectors.probe import KernelSample, ProbeSample
from dlprof_agent.collectors.process import ProcessSample
from dlprof_agent.model.findings import Finding
from dlprof_agent.model.snapshot import NodeSnapshot, Snapshot

CPU_MODES = ("user", "system", "iowait")
# dlprof_framework_info's labels: one fixed set whatever the framework; "" when unknown.
FRAMEWORK_LABELS = ("framework", "framework_version", "device", "intra_op_threads",
                    "inter_op_threads", "omp_num_threads", "mkl_num_threads",
                    "openblas_num_threads", "blas", "cudnn_autotune", "precision",
                    "data_layout", "layer_timing")
LOAD_WINDOWS = ("1m", "5m", "15m")
_Published = TypeVar("_Published", Snapshot, NodeSnapshot)
KERNEL_TRACING_STATES = ("active", "busy", "unavailable")


def _gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def _counter(name: str, doc: str, labels: Iterable[str] = ()) -> CounterMetricFamily:
    # prometheus_client appends _total itself; the contract names carry it.
    return CounterMetricFamily(name.removesuffix("_total"), doc, labels=list(labels))


def process_families(processes: Iterable[ProcessSample]) -> list[Metric]:
    info = _gauge("dlprof_process_info",
                  "Processes the agent reads: the target and its descendants.",
                  ["pid", "ppid", "name", "role"])
    cpu = _counter("dlprof_process_cpu_seconds_total",
                   "CPU seconds by mode; iowait is time blocked on block I/O.", ["pid", "mode"])
    rss = _gauge("dlprof_process_resident_memory_bytes", "Resident memory.", ["pid"])
    rss_peak = _gauge("dlprof_process_resident_memory_peak_bytes",
                      "Highest resident memory since the agent attached.", ["pid"])
    vms = _gauge("dlprof_process_virtual_memory_bytes", "Virtual memory size.", ["pid"])
    threads = _gauge("dlprof_process_threads", "Threads in the process.", ["pid"])
    group_cpu = _counter("dlprof_thread_group_cpu_seconds_total",
                         "CPU seconds of the threads sharing a name, by mode.",
                         ["pid", "thread_name", "mode"])
    group_threads = _gauge("dlprof_thread_group_threads",
                           "Live threads sharing a name.", ["pid", "thread_name"])
    switches = _counter("dlprof_process_context_switches_total",
                        "Context switches: voluntary (waits) and involuntary (preempted).",
                        ["pid", "kind"])
    io = _counter("dlprof_process_io_bytes_total",
                  "Bytes read from and written to storage.", ["pid", "direction"])
    io_logical = _counter("dlprof_process_io_logical_bytes_total",
                          "Bytes passed through read and write system calls, "
                          "page-cache hits included.", ["pid", "direction"])
    fds = _gauge("dlprof_process_open_fds", "Open file descriptors.", ["pid"])
    start = _gauge("dlprof_process_start_time_seconds",
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
        start.add_metric([pid], p.start_time_seconds)
    return [info, cpu, rss, rss_peak, vms, threads, group_cpu, group_threads, switches, io,
            io_logical, fds, start]


def host_families(host: HostSample) -> list[Metric]:
    cpu = _counter("dlprof_host_cpu_seconds_total", "Host CPU seconds by mode, all CPUs.",
                   ["mode"])
    for mode, seconds in host.cpu_seconds:
        cpu.add_metric([mode], seconds)
    cpus = _gauge("dlprof_host_cpus", "CPUs: logical (hardware threads) and physical cores.",
                  ["kind"])
    cpus.add_metric(["logical"], host.logical_cpus)
    if host.physical_cpus is not None:
        cpus.add_metric(["physical"], host.physical_cpus)
    memory_total = _gauge("dlprof_host_memory_total_bytes", "Host memory.")
    memory_total.add_metric([], host.memory_total_bytes)
    memory_available = _gauge("dlprof_host_memory_available_bytes",
                              "Memory available to start new work without swapping.")
    memory_available.add_metric([], host.memory_available_bytes)
    swap_total = _gauge("dlprof_host_swap_total_bytes", "Swap space.")
    swap_total.add_metric([], host.swap_total_bytes)
    swap_used = _gauge("dlprof_host_swap_used_bytes", "Swap space in use.")
    swap_used.add_metric([], host.swap_used_bytes)
    swap_io = _counter("dlprof_host_swap_io_bytes_total",
                       "Bytes swapped in from and out to disk since boot.", ["direction"])
    swap_io.add_metric(["in"], host.swap_in_bytes)
    swap_io.add_metric(["out"], host.swap_out_bytes)
    load = _gauge("dlprof_host_load_average", "Run-queue load average.", ["window"])
    for window, value in zip(LOAD_WINDOWS, host.load_average, strict=True):
        load.add_metric([window], value)
    return [cpu, cpus, memory_total, memory_available, swap_total, swap_used, swap_io, load]


def gpu_families(gpu: GpuSample | None) -> list[Metric]:
    available = _gauge("dlprof_gpu_available",
                       "1 when NVML is loaded and sees at least one GPU, else 0.")
    available.add_metric([], 1 if gpu is not None and gpu.available else 0)
    if gpu is None or not gpu.available:
        return [available]

    device_labels = ["gpu", "uuid"]
    info = _gauge("dlprof_gpu_info", "GPU model and driver.",
                  [*device_labels, "name", "driver_version"])
    up = _gauge("dlprof_gpu_up", "1 while NVML can read the GPU, 0 once it is lost.",
                device_labels)
    # (family, attribute of GpuDeviceSample); a None reading adds no series.
    per_device: list[tuple[GaugeMetricFamily | CounterMetricFamily, str]] = [
        (_gauge("dlprof_gpu_utilization_ratio",
                "Share of time a kernel was running on the GPU.", device_labels),
         "utilization_ratio"),
        (_gauge("dlprof_gpu_memory_utilization_ratio",
                "Share of time device memory was being read or written.", device_labels),
         "memory_utilization_ratio"),
        (_gauge("dlprof_gpu_memory_used_bytes", "Device memory in use.", device_labels),
         "memory_used_bytes"),
        (_gauge("dlprof_gpu_memory_total_bytes", "Device memory.", device_labels),
         "memory_total_bytes"),
        (_gauge("dlprof_gpu_power_watts", "Power draw.", device_labels), "power_watts"),
        (_gauge("dlprof_gpu_power_limit_watts", "Enforced power limit.", device_labels),
         "power_limit_watts"),
        (_counter("dlprof_gpu_energy_joules_total",
                  "Energy used since the driver was loaded.", device_labels),
         "energy_joules"),
        (_gauge("dlprof_gpu_temperature_celsius", "GPU die temperature.", device_labels),
         "temperature_celsius"),
    ]
    pcie = _gauge("dlprof_gpu_pcie_throughput_bytes_per_second",
                  "PCIe throughput over NVML's last 20 ms window; tx is GPU to host.",
                  [*device_labels, "direction"])
    clock = _gauge("dlprof_gpu_clock_hertz", "Current clock frequency.",
                   [*device_labels, "clock"])
    throttle = _gauge("dlprof_gpu_throttle_reason_active",
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
    process_memory = _gauge("dlprof_process_gpu_memory_bytes",
                            "GPU memory the process holds on the device.", process_labels)
    process_sm = _gauge("dlprof_process_gpu_sm_utilization_ratio",
                        "Share of time the process had a kernel on the device's SMs.",
                        process_labels)
    process_memory_util = _gauge("dlprof_process_gpu_memory_utilization_ratio",
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
    info = _gauge("dlprof_agent_info", "The agent's version.", ["version"])
    info.add_metric([__version__], 1)
    interval = _gauge("dlprof_agent_interval_seconds", "Time between sampling passes.")
    interval.add_metric([], interval_seconds)
    errors = _counter("dlprof_collector_errors_total",
                      "Failed reads per collector; each distinct failure is logged once.",
                      ["collector"])
    families: list[Metric] = [info, interval, errors]
    if snapshot is None:
        return families
    for collector, count in snapshot.collector_errors:
        errors.add_metric([collector], count)
    samples = _counter("dlprof_agent_samples_total", "Sampling passes so far.")
    samples.add_metric([], snapshot.samples_total)
    duration = _gauge("dlprof_agent_sample_duration_seconds",
                      "How long the last sampling pass took.")
    duration.add_metric([], snapshot.sample_duration_seconds)
    last = _gauge("dlprof_agent_last_sample_timestamp_seconds",
                  "When the last sampling pass started, in seconds since the Unix epoch.")
    last.add_metric([], snapshot.timestamp_seconds)
    families += [samples, duration, last]
    if snapshot.agent is not None:
        cpu = _counter("dlprof_agent_cpu_seconds_total", "The agent's own CPU seconds.")
        cpu.add_metric([], snapshot.agent.cpu_seconds)
        rss = _gauge("dlprof_agent_resident_memory_bytes", "The agent's own resident memory.")
        rss.add_metric([], snapshot.agent.rss_bytes)
        peak = _gauge("dlprof_agent_resident_memory_peak_bytes",
                      "The agent's own highest resident memory.")
        peak.add_metric([], snapshot.agent.rss_peak_bytes)
        families += [cpu, rss, peak]
    return families


def target_families(snapshot: Snapshot) -> list[Metric]:
    target_up = _gauge("dlprof_target_up",
                       "1 while the attached process runs, 0 once it has exited.", ["pid"])
    target_up.add_metric([str(snapshot.target_pid)], 1 if snapshot.target_up else 0)
    return [target_up]


def _histogram_buckets(bounds: Iterable[float], counts: Iterable[int]
                       ) -> list[tuple[str, float]]:
    cumulative = 0
    buckets: list[tuple[str, float]] = []
    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
    return buckets


def gpu_labels(gpu: GpuSample | None) -> dict[str, str]:
    """GPU UUID -> the ``gpu`` label NVML's series carry (its device index)."""
    if gpu is None:
        return {}
    return {device.uuid: str(device.index) for device in gpu.devices}


def kernel_families(pid: str, kernels: KernelSample, nvml_index: Mapping[str, str]
                    ) -> list[Metric]:
    """The CUPTI tracer's series. ``gpu`` is NVML's index where the device's UUID
    is known to both, else the CUDA ordinal the job sees."""
    uuids = dict(kernels.devices)

    def gpu(device: int) -> str:
        return nvml_index.get(uuids.get(device, ""), str(device))

    state = _gauge("dlprof_kernel_tracing_state",
                   "1 for the kernel tracer's current state (active, busy: another CUPTI "
                   "client holds the process, unavailable), with the reason.",
                   ["pid", "state", "reason"])
    for name in KERNEL_TRACING_STATES:
        current = name == kernels.state
        state.add_metric([pid, name, kernels.reason if current else ""], 1 if current else 0)
    families: list[Metric] = [state]
    if kernels.since:
        since = _gauge("dlprof_kernel_tracing_state_since_timestamp_seconds",
                       "Unix time at which the kernel tracer entered its current state "
                       "(e.g. since when another CUPTI client holds the process).", ["pid"])
        since.add_metric([pid], kernels.since)
        families.append(since)
    if not kernels.traced:
        return families
    seconds = _counter("dlprof_kernel_seconds_total",
                       "GPU time in each kernel (CUPTI); the top kernels by time, the rest "
                       "summed as kernel other.", ["pid", "gpu", "kernel"])
    launches = _counter("dlprof_kernel_launches_total", "Launches of each kernel.",
                        ["pid", "gpu", "kernel"])
    for row in kernels.kernels:
        labels = [pid, gpu(row.device), row.kernel]
        seconds.add_metric(labels, row.seconds)
        launches.add_metric(labels, row.launches)
    duration = HistogramMetricFamily("dlprof_kernel_duration_seconds",
                                     "Duration of each kernel run.", labels=["pid", "gpu"])
    for entry in kernels.durations:
        duration.add_metric([pid, gpu(entry.device)],
                            _histogram_buckets(kernels.duration_bucket_bounds,
                                               entry.bucket_counts), entry.seconds_sum)
    copied = _counter("dlprof_memcpy_bytes_total",
                      "Bytes copied, by direction (h2d, d2h, d2d, p2p).", ["pid", "gpu", "kind"])
    copying = _counter("dlprof_memcpy_seconds_total", "Time spent copying, by direction.",
                       ["pid", "gpu", "kind"])
    for copy in kernels.memcpy:
        labels = [pid, gpu(copy.device), copy.kind]
        copied.add_metric(labels, copy.bytes)
        copying.add_metric(labels, copy.seconds)
    layers = _counter("dlprof_layer_gpu_seconds_total",
                      "GPU time of the kernels each layer launched, by phase (with --layers).",
                      ["pid", "layer", "phase"])
    for layer in kernels.layers:
        layers.add_metric([pid, layer.layer, layer.phase], layer.seconds)
    overhead = _counter("dlprof_cupti_overhead_seconds_total",
                        "Time CUPTI itself spent (its overhead records).", ["pid"])
    overhead.add_metric([pid], kernels.overhead_seconds)
    dropped = _counter("dlprof_cupti_dropped_records_total",
                       "Activity records CUPTI dropped for want of buffer space.", ["pid"])
    dropped.add_metric([pid], kernels.dropped_records)
    return [*families, seconds, launches, duration, copied, copying, layers, overhead, dropped]


def probe_families(target_pid: int, up: bool, probe: ProbeSample | None,
                   gpu: GpuSample | None = None) -> list[Metric]:
    probe_up = _gauge("dlprof_probe_up",
                      "1 while the agent reads the in-process probe of the process, else 0.",
                      ["pid"])
    probe_up.add_metric([str(target_pid)], 1 if up else 0)
    if probe is None:
        return [probe_up]
    pid = str(probe.pid)
    steps = _counter("dlprof_steps_total",
                     "Training steps; the first ones are warm-up, kept out of the "
                     "steady-state figures.", ["pid", "phase"])
    samples = _counter("dlprof_samples_total",
                       "Samples (batch elements) trained on; rate() gives samples per second.",
                       ["pid", "phase"])
    for phase, count in probe.steps:
        steps.add_metric([pid, phase], count)
    for phase, count in probe.samples:
        samples.add_metric([pid, phase], count)
    duration = HistogramMetricFamily(
        "dlprof_step_duration_seconds",
        "Steady-state training step time, from one step's end to the next.", labels=["pid"])
    duration.add_metric([pid], _histogram_buckets(probe.step_bucket_bounds,
                                                  probe.step_bucket_counts),
                        probe.step_seconds_sum)
    phases = _counter("dlprof_step_phase_seconds_total",
                      "Steady-state step time by phase: forward and backward (summed over "
                      "layers, with --layers), optimizer, and other (data, loss, Python).",
                      ["pid", "phase"])
    for phase, seconds in probe.phase_seconds:
        phases.add_metric([pid, phase], seconds)
    layer_seconds = _counter("dlprof_layer_seconds_total",
                             "Time in each layer, forward and backward (with --layers), "
                             "estimated for every step from the timed ones.",
                             ["pid", "layer", "phase"])
    layer_calls = _counter("dlprof_layer_calls_total",
                           "Calls of each layer, by phase, estimated like the time.",
                           ["pid", "layer", "phase"])
    sampled = _counter("dlprof_layer_sampled_steps_total",
                       "Steady steps whose layers were timed (with --layers); the layer "
                       "counters are estimated from these.", ["pid"])
    if probe.layer_sampled_steps is not None:
        sampled.add_metric([pid], probe.layer_sampled_steps)
    for layer in probe.layers:
        for phase, seconds, calls in (
                ("forward", layer.forward_seconds, layer.forward_calls),
                ("backward", layer.backward_seconds, layer.backward_calls)):
            if calls:
                layer_seconds.add_metric([pid, layer.name, phase], seconds)
                layer_calls.add_metric([pid, layer.name, phase], calls)
    info = _gauge("dlprof_framework_info",
                  "The framework settings the job runs with, as the job itself sees them.",
                  ["pid", *FRAMEWORK_LABELS])
    for framework, settings in probe.settings:
        values = dict(settings)
        values.setdefault("framework", framework)
        info.add_metric([pid, *(values.get(label, "") for label in FRAMEWORK_LABELS)], 1)
    hook_errors = _counter("dlprof_probe_hook_errors_total",
                           "Failures inside the probe's hooks, caught before reaching the job.",
                           ["pid"])
    hook_errors.add_metric([pid], probe.hook_errors)
    dropped = _counter("dlprof_probe_dropped_messages_total",
                       "Messages and connections the probe refused: malformed, oversized, "
                       "unknown, wrong version, from another user, or too slow.", ["pid", "reason"])
    for reason, count in probe.dropped_messages:
        dropped.add_metric([pid, reason], count)
    kernels = (kernel_families(pid, probe.kernels, gpu_labels(gpu))
               if probe.kernels is not None else [])
    return [probe_up, steps, samples, duration, phases, layer_seconds, layer_calls, sampled,
            info, hook_errors, dropped, *kernels]


def finding_families(target_pid: int, findings: Iterable[Finding]) -> list[Metric]:
    """Every rule that could judge the target: 1 while its finding is raised, else 0
    (absent: nothing to judge, e.g. no probe or no GPU)."""
    findings = list(findings)
    if not findings:
        return []
    pid = str(target_pid)
    state = _gauge("dlprof_finding",
                   "1 while a finding about the job holds, 0 while its rule sees no cause; "
                   "docs/findings.md explains each.", ["pid", "finding", "severity"])
    evidence = _gauge("dlprof_finding_evidence",
                      "The figures each finding's rule judged, over its last window; the "
                      "quantity's name ends in its unit.", ["pid", "finding", "quantity"])
    for finding in findings:
        state.add_metric([pid, finding.id, finding.severity], 1 if finding.active else 0)
        for quantity, value in finding.evidence:
            evidence.add_metric([pid, finding.id, quantity], value)
    return [state, evidence]


class _LatestCollector(Collector, Generic[_Published]):
    """Renders whatever ``latest`` returns at scrape time; reads nothing itself."""

    def __init__(self, latest: Callable[[], _Published | None], *,
                 interval_seconds: float) -> None:
        self._latest: Callable[[], _Published | None] = latest
        self._interval_seconds = interval_seconds

    def describe(self) -> Iterable[Metric]:
        # Empty: registration must not call collect(), which needs a sample.
        return []


class SnapshotCollector(_LatestCollector[Snapshot]):
    """One target: the agent's latest Snapshot."""

    def collect(self) -> Iterator[Metric]:
        snapshot = self._latest()
        yield from agent_families(snapshot, self._interval_seconds)
        if snapshot is None:
            return
        yield from target_families(snapshot)
        yield from process_families(snapshot.processes)
        if snapshot.host is not None:
            yield from host_families(snapshot.host)
        yield from gpu_families(snapshot.gpu)
        yield from probe_families(snapshot.target_pid, snapshot.probe_up, snapshot.probe,
                                  snapshot.gpu)
        yield from finding_families(snapshot.target_pid, snapshot.findings)


def merged(per_target: Iterable[list[Metric]]) -> list[Metric]:
    """One family per name, holding every target's samples: an exposition may
    name a family only once."""
    families: dict[str, Metric] = {}
    for target in per_target:
        for family in target:
            known = families.get(family.name)
            if known is None:
                families[family.name] = family
            else:
                known.samples.extend(family.samples)
    return list(families.values())


class NodeCollector(_LatestCollector[NodeSnapshot]):
    """The daemon's latest pass: the node once, and every target, each under its
    own pid. A target that has gone is simply not in the pass."""

    def collect(self) -> Iterator[Metric]:
        node = self._latest()
        yield from agent_families(node, self._interval_seconds)
        if node is None:
            return
        yield from merged(target_families(target) for target in node.targets)
        yield from merged(process_families(target.processes) for target in node.targets)
        if node.host is not None:
            yield from host_families(node.host)
        yield from gpu_families(node.gpu)
        yield from merged(probe_families(target.target_pid, target.probe_up, target.probe,
                                         node.gpu)
                          for target in node.targets)
        yield from merged(finding_families(target.target_pid, target.findings)
                          for target in node.targets)


def registry_of(collector: Collector) -> CollectorRegistry:
    """A registry holding ``collector`` alone: what exporters.http serves."""
    registry = CollectorRegistry()
    registry.register(collector)
    return registry
