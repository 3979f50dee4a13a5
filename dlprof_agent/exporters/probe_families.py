"""The metric families of the in-process probe: steps, phases, layers, the
framework's settings, and the CUPTI tracer's kernels and copies."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client.core import (
    HistogramMetricFamily,
    Metric,
)

from dlprof_agent.collectors.gpu_samples import GpuSample
from dlprof_agent.collectors.identity import Identity
from dlprof_agent.exporters.families import JOB_LABELS, counter, gauge
from dlprof_agent.probe_link.samples import KernelSample, ProbeSample

# dlprof_framework_info's labels: one fixed set whatever the framework; "" when unknown.
FRAMEWORK_LABELS = ("framework", "framework_version", "device", "intra_op_threads",
                    "inter_op_threads", "omp_num_threads", "mkl_num_threads",
                    "openblas_num_threads", "blas", "cudnn_autotune", "precision",
                    "data_layout", "layer_timing")
KERNEL_TRACING_STATES = ("active", "busy", "unavailable")


def histogram_buckets(bounds: Iterable[float], counts: Iterable[int]
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

    state = gauge("dlprof_kernel_tracing_state",
                  "1 for the kernel tracer's current state (active, busy: another CUPTI "
                  "client holds the process, unavailable), with the reason.",
                  ["pid", "state", "reason"])
    for name in KERNEL_TRACING_STATES:
        current = name == kernels.state
        state.add_metric([pid, name, kernels.reason if current else ""], 1 if current else 0)
    families: list[Metric] = [state]
    if kernels.since:
        since = gauge("dlprof_kernel_tracing_state_since_timestamp_seconds",
                      "Unix time at which the kernel tracer entered its current state "
                      "(e.g. since when another CUPTI client holds the process).", ["pid"])
        since.add_metric([pid], kernels.since)
        families.append(since)
    if not kernels.traced:
        return families
    seconds = counter("dlprof_kernel_seconds_total",
                      "GPU time in each kernel (CUPTI); the top kernels by time, the rest "
                      "summed as kernel other.", ["pid", "gpu", "kernel"])
    launches = counter("dlprof_kernel_launches_total", "Launches of each kernel.",
                       ["pid", "gpu", "kernel"])
    for row in kernels.kernels:
        labels = [pid, gpu(row.device), row.kernel]
        seconds.add_metric(labels, row.seconds)
        launches.add_metric(labels, row.launches)
    duration = HistogramMetricFamily("dlprof_kernel_duration_seconds",
                                     "Duration of each kernel run.", labels=["pid", "gpu"])
    for entry in kernels.durations:
        duration.add_metric([pid, gpu(entry.device)],
                            histogram_buckets(kernels.duration_bucket_bounds,
                                              entry.bucket_counts), entry.seconds_sum)
    copied = counter("dlprof_memcpy_bytes_total",
                     "Bytes copied, by direction (h2d, d2h, d2d, p2p).", ["pid", "gpu", "kind"])
    copying = counter("dlprof_memcpy_seconds_total", "Time spent copying, by direction.",
                      ["pid", "gpu", "kind"])
    for copy in kernels.memcpy:
        labels = [pid, gpu(copy.device), copy.kind]
        copied.add_metric(labels, copy.bytes)
        copying.add_metric(labels, copy.seconds)
    layers = counter("dlprof_layer_gpu_seconds_total",
                     "GPU time of the kernels each layer launched, by phase (with --layers).",
                     ["pid", "layer", "phase"])
    for layer in kernels.layers:
        layers.add_metric([pid, layer.layer, layer.phase], layer.seconds)
    overhead = counter("dlprof_cupti_overhead_seconds_total",
                       "Time CUPTI itself spent (its overhead records).", ["pid"])
    overhead.add_metric([pid], kernels.overhead_seconds)
    dropped = counter("dlprof_cupti_dropped_records_total",
                      "Activity records CUPTI dropped for want of buffer space.", ["pid"])
    dropped.add_metric([pid], kernels.dropped_records)
    families += [seconds, launches, duration, copied, copying, layers, overhead, dropped]
    if kernels.record_clock:
        clock = gauge("dlprof_cupti_record_clock_info",
                      "1 for the clock CUPTI's records count in: native (CUPTI's ns) or "
                      "foreign (another client registered its own, e.g. torch.profiler's "
                      "TSC; converted to ns), and how that was measured.",
                      ["pid", "clock", "measured_by"])
        clock.add_metric([pid, kernels.record_clock, kernels.record_clock_measured_by], 1)
        ticks = gauge("dlprof_cupti_record_clock_ticks_per_ns",
                      "Rate of the clock CUPTI's records count in, per ns of real time "
                      "(1 for CUPTI's own).", ["pid"])
        ticks.add_metric([pid], kernels.record_ticks_per_ns)
        unmeasured = counter("dlprof_cupti_unmeasured_batches_total",
                             "Batches of records dropped because the clock they count in "
                             "could not be measured (never reported in unknown units).",
                             ["pid"])
        unmeasured.add_metric([pid], kernels.unmeasured_batches)
        families += [clock, ticks, unmeasured]
    return families


def job_labels(identity: Identity | None) -> list[str]:
    """The values of ``job_id`` and ``rank``, the labels after ``pid`` on the
    per-target step, phase and finding families ("" where unknown)."""
    return ["", ""] if identity is None else [identity.job_id, identity.rank]


def probe_families(target_pid: int, up: bool, probe: ProbeSample | None,
                   gpu: GpuSample | None = None, identity: Identity | None = None
                   ) -> list[Metric]:
    probe_up = gauge("dlprof_probe_up",
                     "1 while the agent reads the in-process probe of the process, else 0.",
                     ["pid"])
    probe_up.add_metric([str(target_pid)], 1 if up else 0)
    if probe is None:
        return [probe_up]
    pid = str(probe.pid)
    job = [pid, *job_labels(identity)]  # pid, job_id, rank
    steps = counter("dlprof_steps_total",
                    "Training steps; the first ones are warm-up, kept out of the "
                    "steady-state figures.", ["pid", *JOB_LABELS, "phase"])
    samples = counter("dlprof_samples_total",
                      "Samples (batch elements) trained on; rate() gives samples per second.",
                      ["pid", *JOB_LABELS, "phase"])
    for phase, count in probe.steps:
        steps.add_metric([*job, phase], count)
    for phase, count in probe.samples:
        samples.add_metric([*job, phase], count)
    duration = HistogramMetricFamily(
        "dlprof_step_duration_seconds",
        "Steady-state training step time, from one step's end to the next.",
        labels=["pid", *JOB_LABELS])
    duration.add_metric(job, histogram_buckets(probe.step_bucket_bounds,
                                               probe.step_bucket_counts),
                        probe.step_seconds_sum)
    phases = counter("dlprof_step_phase_seconds_total",
                     "Steady-state step time by phase: forward and backward (unless "
                     "--no-split), optimizer, exchange (waiting for other ranks in "
                     "collectives), and other (data, loss, Python).",
                     ["pid", *JOB_LABELS, "phase"])
    for phase, seconds in probe.phase_seconds:
        phases.add_metric([*job, phase], seconds)
    split = gauge("dlprof_step_phase_split_info",
                  "1, with whether the latest steady step's phases were split, or why not "
                  "(forward not seen, backward not seen, not split: compiled graph, not "
                  "split: turned off).",
                  ["pid", *JOB_LABELS, "split"])
    if probe.phase_split is not None:
        split.add_metric([*job, probe.phase_split], 1)
    layer_seconds = counter("dlprof_layer_seconds_total",
                            "Time in each layer, forward and backward (with --layers), "
                            "estimated for every step from the timed ones.",
                            ["pid", "layer", "phase"])
    layer_calls = counter("dlprof_layer_calls_total",
                          "Calls of each layer, by phase, estimated like the time.",
                          ["pid", "layer", "phase"])
    sampled = counter("dlprof_layer_sampled_steps_total",
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
    info = gauge("dlprof_framework_info",
                 "The framework settings the job runs with, as the job itself sees them.",
                 ["pid", *FRAMEWORK_LABELS])
    for framework, settings in probe.settings:
        values = dict(settings)
        values.setdefault("framework", framework)
        info.add_metric([pid, *(values.get(label, "") for label in FRAMEWORK_LABELS)], 1)
    hook_errors = counter("dlprof_probe_hook_errors_total",
                          "Failures inside the probe's hooks, caught before reaching the job.",
                          ["pid"])
    hook_errors.add_metric([pid], probe.hook_errors)
    own_cpu = counter("dlprof_probe_cpu_seconds_total",
                      "CPU time the probe itself took in the job, by part: hooks (its step "
                      "and phase hooks on the job's threads), layers (what steps with "
                      "timed layers added over the others), thread (its own thread: "
                      "replies, kernel records).", ["pid", "part"])
    for part, seconds in probe.cpu_seconds:
        own_cpu.add_metric([pid, part], seconds)
    dropped = counter("dlprof_probe_dropped_messages_total",
                      "Messages and connections the probe refused: malformed, oversized, "
                      "unknown, wrong version, from another user, or too slow.", ["pid", "reason"])
    for reason, count in probe.dropped_messages:
        dropped.add_metric([pid, reason], count)
    held = counter("dlprof_probe_replies_held_total",
                   "Passes that decoded no reply of the probe, its last sample standing in: "
                   "its replies are larger than the agent's byte budget per pass.", ["pid"])
    held.add_metric([pid], probe.replies_held)
    kernels = (kernel_families(pid, probe.kernels, gpu_labels(gpu))
               if probe.kernels is not None else [])
    collective = counter("dlprof_collective_kernel_seconds_total",
                         "GPU time in collective communication (NCCL) kernels, from CUPTI: "
                         "on NCCL a rank's wait for the others runs there, not on the host.",
                         ["pid", *JOB_LABELS])
    in_collectives = (probe.kernels.collective_seconds()
                      if probe.kernels is not None and probe.kernels.traced else None)
    if in_collectives is not None:
        collective.add_metric(job, in_collectives)
    return [probe_up, steps, samples, duration, phases, split, collective, layer_seconds,
            layer_calls, sampled, info, hook_errors, own_cpu, dropped, held, *kernels]
