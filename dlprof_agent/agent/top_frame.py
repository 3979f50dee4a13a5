"""What `top` shows of one job, as plain figures: built from two reads of the
metrics (``Readings``) a refresh apart, so that the screen is the same whether
the reads came from this agent's own collector or from another agent's or a
daemon's /metrics. Counters become rates between the two reads; a figure the
metrics lack stays None and its panel says so."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from dlprof_agent.exporters.metrics_reader import Readings
from dlprof_agent.model.findings.catalogue import KINDS_BY_ID, SEVERITIES

PHASES = ("forward", "backward", "compiled", "optimizer", "exchange", "other", "unsplit")


@dataclass(frozen=True)
class LayerRow:
    name: str
    step_ratio: float  # share of the step time, forward and backward together
    forward_seconds: float  # per step
    backward_seconds: float


@dataclass(frozen=True)
class KernelRow:
    name: str
    gpu: str
    busy_ratio: float  # GPU seconds per second of wall time


@dataclass(frozen=True)
class ThreadRow:
    name: str
    threads: int
    cores: float  # CPU seconds per second, all modes


@dataclass(frozen=True)
class GpuRow:
    gpu: str
    name: str
    utilization_ratio: float | None
    memory_used_bytes: float | None
    memory_total_bytes: float | None
    power_watts: float | None
    sm_clock_hertz: float | None


@dataclass(frozen=True)
class FindingRow:
    id: str
    severity: str
    summary: str
    advice: str
    evidence: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class TargetRow:
    """One job of a daemon, for the targets table."""

    pid: int
    job: str
    rank: str
    up: bool
    steps_per_second: float | None
    own_step_seconds: float | None  # step time less the wait for other ranks


@dataclass(frozen=True)
class Frame:
    pid: int
    name: str
    who: str  # job and rank, node, where known
    up: bool
    probe: str  # up, stale, or none
    interval_seconds: float | None  # between the two reads; None on the first
    steps_total: int
    steps_per_second: float | None
    step_seconds: float | None
    samples_per_second: float | None
    split: tuple[tuple[str, float], ...]  # phase, share of the step time
    split_state: str  # "split", or why not; "" before any steady step
    layer_timing: str  # on, off, or "" when the framework does not say
    layers: tuple[LayerRow, ...]
    kernel_state: str  # the tracer's state and reason
    kernels: tuple[KernelRow, ...]
    memcpy: tuple[tuple[str, float], ...]  # kind, bytes per second
    cpu_cores: tuple[tuple[str, float], ...]  # mode, CPU seconds per second
    threads: tuple[ThreadRow, ...]
    rss_bytes: float | None
    rss_peak_bytes: float | None
    gpus: tuple[GpuRow, ...]
    gpu_available: bool
    findings: tuple[FindingRow, ...]
    agent_cores: float | None  # the agent's own CPU, as its metrics say


def _rate(now: float | None, before: float | None, seconds: float | None) -> float | None:
    if now is None or before is None or not seconds or seconds <= 0:
        return None
    return max(0.0, now - before) / seconds


def _sample_time(readings: Readings) -> float | None:
    return readings.value("dlprof_agent_last_sample_timestamp_seconds")


def target_pids(readings: Readings) -> list[int]:
    """The targets the metrics hold, in pid order."""
    return sorted({int(labels["pid"]) for labels, _ in readings.rows("dlprof_target_up")
                   if labels.get("pid", "").isdigit()})


def tree(readings: Readings, pid: int) -> set[str]:
    """``pid`` and its descendants among the processes the metrics hold."""
    parent = {labels["pid"]: labels.get("ppid", "")
              for labels, _ in readings.rows("dlprof_process_info")}
    members = {str(pid)}
    for child in parent:
        seen, up = set(), child
        while up in parent and up not in members and up not in seen:
            seen.add(up)
            up = parent[up]
        if up in members:
            members |= seen
    return members


def _by_label(readings: Readings, name: str, label: str, pids: set[str],
              **labels: str) -> dict[str, float]:
    sums: dict[str, float] = defaultdict(float)
    for have, value in readings.rows(name, **labels):
        if have.get("pid") in pids:
            sums[have.get(label, "")] += value
    return dict(sums)


def _sum(readings: Readings, name: str, pids: set[str], **labels: str) -> float | None:
    rows = [value for have, value in readings.rows(name, **labels) if have.get("pid") in pids]
    return sum(rows) if rows else None


def _deltas(now: Mapping[str, float], before: Mapping[str, float] | None) -> dict[str, float]:
    """Per key, the change since ``before``; the totals themselves without it."""
    if before is None:
        return dict(now)
    return {key: max(0.0, value - before.get(key, 0.0)) for key, value in now.items()}


def _who(readings: Readings, pid: int) -> str:
    rows = readings.rows("dlprof_target_info", pid=str(pid))
    if not rows:
        return ""
    labels = rows[0][0]
    parts = [f"job {labels['job_id']}" if labels.get("job_id") else "",
             f"rank {labels['rank']}" if labels.get("rank") else "",
             f"on {labels['node']}" if labels.get("node") else ""]
    return " ".join(part for part in parts if part)


def build_frame(now: Readings, before: Readings | None, pid: int) -> Frame:
    """The frame of target ``pid`` from the latest read, with rates since ``before``."""
    own = {str(pid)}
    pids = tree(now, pid)
    then, at = _sample_time(now), None if before is None else _sample_time(before)
    seconds = None if then is None or at is None or then <= at else then - at

    def counter(name: str, among: set[str], **labels: str) -> tuple[float | None, float | None]:
        return _sum(now, name, among, **labels), (
            None if before is None else _sum(before, name, among, **labels))

    steady, steady_before = counter("dlprof_steps_total", own, phase="steady")
    warmup = _sum(now, "dlprof_steps_total", own, phase="warmup") or 0.0
    step_sum, step_sum_before = counter("dlprof_step_duration_seconds_sum", own)
    samples, samples_before = counter("dlprof_samples_total", own, phase="steady")
    steps_in = (None if steady is None or steady_before is None
                else max(0.0, steady - steady_before))
    step_seconds = None
    if steps_in and step_sum is not None and step_sum_before is not None:
        step_seconds = (step_sum - step_sum_before) / steps_in
    elif steady and step_sum:
        step_seconds = step_sum / steady  # nothing new this refresh: the mean so far
    samples_rate = _rate(samples, samples_before, seconds)
    steps_rate = _rate(steady, steady_before, seconds)
    if steady_before is None and step_seconds:  # the probe's first answer: its means so far
        steps_rate = 1 / step_seconds
        samples_rate = samples / step_sum if samples and step_sum else None

    # The split and layers over the refresh when steps ended in it, else since attach.
    interval = bool(steps_in) and before is not None
    phases_now = _by_label(now, "dlprof_step_phase_seconds_total", "phase", own)
    phases = _deltas(phases_now, _by_label(before, "dlprof_step_phase_seconds_total", "phase",
                                           own) if interval and before else None)
    step_total = sum(phases.values())
    split = tuple((phase, phases[phase] / step_total) for phase in PHASES
                  if phases.get(phase) and step_total > 0)
    split_rows = [labels.get("split", "") for labels, value
                  in now.rows("dlprof_step_phase_split_info", pid=str(pid)) if value]
    steps_for_layers = steps_in if interval else steady
    layers = _layers(now, before if interval else None, own, steps_for_layers or 0.0,
                     step_seconds)

    timing = [labels.get("layer_timing", "") for labels, _
              in now.rows("dlprof_framework_info", pid=str(pid))]
    states = [f"{labels.get('state', '')}" + (f": {labels['reason']}" if labels.get("reason")
                                               else "")
              for labels, value in now.rows("dlprof_kernel_tracing_state", pid=str(pid))
              if value]
    kernels_now = {(labels.get("kernel", ""), labels.get("gpu", "")): value
                   for labels, value in now.rows("dlprof_kernel_seconds_total")
                   if labels.get("pid") in pids}
    kernels_before = {} if before is None else {
        (labels.get("kernel", ""), labels.get("gpu", "")): value
        for labels, value in before.rows("dlprof_kernel_seconds_total")
        if labels.get("pid") in pids}
    kernels = tuple(KernelRow(name, gpu, rate) for (name, gpu), value in kernels_now.items()
                    if (rate := _rate(value, kernels_before.get((name, gpu), 0.0), seconds)))
    memcpy_now = _by_label(now, "dlprof_memcpy_bytes_total", "kind", pids)
    memcpy_before = None if before is None else _by_label(
        before, "dlprof_memcpy_bytes_total", "kind", pids)
    memcpy = tuple((kind, rate) for kind, value in sorted(memcpy_now.items())
                   if memcpy_before is not None
                   and (rate := _rate(value, memcpy_before.get(kind, 0.0), seconds)))

    cpu_now = _by_label(now, "dlprof_process_cpu_seconds_total", "mode", pids)
    cpu_before = None if before is None else _by_label(
        before, "dlprof_process_cpu_seconds_total", "mode", pids)
    cpu = tuple((mode, rate) for mode in ("user", "system", "iowait")
                if cpu_before is not None
                and (rate := _rate(cpu_now.get(mode), cpu_before.get(mode), seconds)) is not None)

    probe_up = _sum(now, "dlprof_probe_up", own)
    stale = _sum(now, "dlprof_probe_stale", own)
    name_rows = [labels.get("name", "") for labels, _
                 in now.rows("dlprof_process_info", pid=str(pid))]
    agent_cpu = now.value("dlprof_agent_cpu_seconds_total")
    return Frame(
        pid=pid, name=name_rows[0] if name_rows else "?", who=_who(now, pid),
        up=bool(_sum(now, "dlprof_target_up", own)),
        probe="stale" if probe_up and stale else "up" if probe_up else "none",
        interval_seconds=seconds, steps_total=int((steady or 0.0) + warmup),
        steps_per_second=steps_rate,
        step_seconds=step_seconds,
        samples_per_second=samples_rate if samples_rate else None,
        split=split, split_state=split_rows[0] if split_rows else "",
        layer_timing=timing[0] if timing else "", layers=layers,
        kernel_state=states[0] if states else "", kernels=kernels, memcpy=memcpy,
        cpu_cores=cpu, threads=_threads(now, before, pids, seconds),
        rss_bytes=_sum(now, "dlprof_process_resident_memory_bytes", pids),
        rss_peak_bytes=_sum(now, "dlprof_process_resident_memory_peak_bytes", pids),
        gpus=_gpus(now), gpu_available=bool(now.value("dlprof_gpu_available")),
        findings=_findings(now, pid),
        agent_cores=_rate(agent_cpu, None if before is None else before.value(
            "dlprof_agent_cpu_seconds_total"), seconds))


def _layers(now: Readings, before: Readings | None, own: set[str], steps: float,
            step_seconds: float | None) -> tuple[LayerRow, ...]:
    if not steps or not step_seconds:
        return ()
    seconds: dict[tuple[str, str], float] = defaultdict(float)
    for labels, value in now.rows("dlprof_layer_seconds_total"):
        if labels.get("pid") in own:
            seconds[labels.get("layer", ""), labels.get("phase", "")] += value
    if before is not None:
        for labels, value in before.rows("dlprof_layer_seconds_total"):
            key = (labels.get("layer", ""), labels.get("phase", ""))
            if labels.get("pid") in own and key in seconds:
                seconds[key] = max(0.0, seconds[key] - value)
    names = {layer for layer, _ in seconds}
    rows = []
    for layer in names:
        forward = seconds.get((layer, "forward"), 0.0) / steps
        backward = seconds.get((layer, "backward"), 0.0) / steps
        rows.append(LayerRow(layer, (forward + backward) / step_seconds, forward, backward))
    return tuple(row for row in rows if row.step_ratio > 0)


def _threads(now: Readings, before: Readings | None, pids: set[str],
             seconds: float | None) -> tuple[ThreadRow, ...]:
    counts = _by_label(now, "dlprof_thread_group_threads", "thread_name", pids)
    cpu = _by_label(now, "dlprof_thread_group_cpu_seconds_total", "thread_name", pids)
    cpu_before = {} if before is None else _by_label(
        before, "dlprof_thread_group_cpu_seconds_total", "thread_name", pids)
    return tuple(ThreadRow(name, int(count),
                           _rate(cpu.get(name), cpu_before.get(name), seconds) or 0.0)
                 for name, count in counts.items() if count)


def _gpus(now: Readings) -> tuple[GpuRow, ...]:
    names = {labels.get("gpu", ""): labels.get("name", "")
             for labels, _ in now.rows("dlprof_gpu_info")}

    def of(name: str, gpu: str, **labels: str) -> float | None:
        return now.value(name, gpu=gpu, **labels)

    return tuple(GpuRow(gpu, names[gpu], of("dlprof_gpu_utilization_ratio", gpu),
                        of("dlprof_gpu_memory_used_bytes", gpu),
                        of("dlprof_gpu_memory_total_bytes", gpu),
                        of("dlprof_gpu_power_watts", gpu),
                        of("dlprof_gpu_clock_hertz", gpu, clock="sm"))
                 for gpu in sorted(names, key=lambda gpu: (len(gpu), gpu)))


def _findings(now: Readings, pid: int) -> tuple[FindingRow, ...]:
    rows = []
    for labels, value in now.rows("dlprof_finding", pid=str(pid)):
        if value != 1:
            continue
        finding = labels.get("finding", "")
        kind = KINDS_BY_ID.get(finding)
        evidence = tuple((have.get("quantity", ""), figure) for have, figure
                         in now.rows("dlprof_finding_evidence", pid=str(pid), finding=finding))
        rows.append(FindingRow(finding, labels.get("severity", ""),
                               kind.summary if kind else finding,
                               kind.advice if kind else "", evidence))
    return tuple(sorted(rows, key=lambda row: (
        -SEVERITIES.index(row.severity) if row.severity in SEVERITIES else 0, row.id)))


def target_rows(now: Readings, before: Readings | None) -> tuple[TargetRow, ...]:
    """A daemon's jobs, one row each, for the table `top --url` opens with."""
    then, at = _sample_time(now), None if before is None else _sample_time(before)
    seconds = None if then is None or at is None or then <= at else then - at
    rows = []
    for pid in target_pids(now):
        own = {str(pid)}
        info = now.rows("dlprof_target_info", pid=str(pid))
        labels = info[0][0] if info else {}
        steady = _sum(now, "dlprof_steps_total", own, phase="steady")
        steady_before = None if before is None else _sum(before, "dlprof_steps_total", own,
                                                         phase="steady")
        step_sum = _sum(now, "dlprof_step_duration_seconds_sum", own)
        exchange = _sum(now, "dlprof_step_phase_seconds_total", own, phase="exchange") or 0.0
        own_step = (step_sum - exchange) / steady if steady and step_sum else None
        rows.append(TargetRow(pid, labels.get("job_id", ""), labels.get("rank", ""),
                              bool(_sum(now, "dlprof_target_up", own)),
                              _rate(steady, steady_before, seconds), own_step))
    return tuple(rows)
