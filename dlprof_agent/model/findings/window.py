"""What the rules see: each sample reduced to a Point, and a Window of the last
few seconds of them, with the rates and shares the rules read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from math import fsum

from dlprof_agent.collectors.gpu_samples import GpuSample
from dlprof_agent.collectors.host import HostSample
from dlprof_agent.collectors.limits import LimitsSample
from dlprof_agent.model.snapshot import AgentSelfSample, Snapshot
from dlprof_agent.probe.messages import COMPILED_PHASE, EXCHANGE_PHASE, SPLIT
from dlprof_agent.probe_link.samples import ProbeSample


def _mean(values: list[float]) -> float:
    # statistics.fmean's value (fsum over the length) without its import, which
    # brings fractions and decimal into the daemon.
    return fsum(values) / len(values)

# ---- Timing ------------------------------------------------------------------------
# Rates come from the samples of the last WINDOW_SECONDS: long enough to span
# several steps of a typical job and several scheduler periods, short enough that
# a finding follows a change of setting within seconds.
WINDOW_SECONDS = 3.0
# A window shorter than this says too little (the first samples after attach).
MIN_WINDOW_SECONDS = 1.5
# Step-based rules want at least this many steady steps in the window, so that
# the step split is an average and not one step's accident.
MIN_WINDOW_STEPS = 3
# A step split says where the step went only when every phase of a training step
# was seen: a phase the hooks missed (backward in a compiled graph, an optimizer
# that is not torch.optim) falls into "other", where it reads as time for input.
SPLIT_PHASES = ("forward", "backward", "optimizer")
# A torch.compile'd train step: forward and backward timed together as one phase.
COMPILED_SPLIT_PHASES = (COMPILED_PHASE, "optimizer")
# The probe's process_group setting of a job that is no rank of several.
NO_PROCESS_GROUP = "none"


@dataclass(frozen=True, slots=True)
class Point:
    """One sample, reduced to what the rules need."""

    seconds: float  # the agent's monotonic clock
    user_seconds: float  # the process tree's totals
    system_seconds: float
    iowait_seconds: float
    target_busy_seconds: float  # the target alone: the process that launches kernels
    involuntary_switches: int
    runnable_threads: int | None
    # The target's main thread: waiting for a CPU and on one (schedstat), None unknown.
    main_wait_seconds: float | None
    main_run_seconds: float | None
    rss_bytes: int
    host: HostSample | None
    gpu: GpuSample | None
    limits: LimitsSample | None
    probe: ProbeSample | None
    agent_cpu_seconds: float | None
    pids: frozenset[int]


@dataclass(frozen=True, slots=True)
class Window:
    """The samples of the last few seconds, oldest first, at least two."""

    points: tuple[Point, ...]
    # kernel_seconds, once per window: four rules read it, over up to a budget's
    # worth of kernel rows per target.
    _kernel_seconds: list[dict[str, float] | None] = field(
        default_factory=list, init=False, compare=False, repr=False)

    @property
    def first(self) -> Point:
        return self.points[0]

    @property
    def last(self) -> Point:
        return self.points[-1]

    @property
    def seconds(self) -> float:
        return self.last.seconds - self.first.seconds

    def rate(self, read: Callable[[Point], float | None]) -> float | None:
        before, after = read(self.first), read(self.last)
        if before is None or after is None or self.seconds <= 0:
            return None
        return (after - before) / self.seconds

    def mean_runnable_threads(self) -> float | None:
        runnable = [p.runnable_threads for p in self.points]
        if any(r is None for r in runnable):
            return None
        return _mean(runnable)  # type: ignore[arg-type]  # no None: checked

    def main_thread_waits(self) -> tuple[float, float] | None:
        """The target's main thread over the window: (seconds it waited in a run queue
        for a CPU, seconds it was runnable: that wait and its time on a CPU)."""
        waits = (self.first.main_wait_seconds, self.last.main_wait_seconds)
        runs = (self.first.main_run_seconds, self.last.main_run_seconds)
        if self.seconds <= 0 or waits[0] is None or waits[1] is None \
                or runs[0] is None or runs[1] is None:
            return None
        wait, run = waits[1] - waits[0], runs[1] - runs[0]
        return wait, wait + run

    def busy_cores(self) -> float:
        return ((self.last.user_seconds + self.last.system_seconds
                 - self.first.user_seconds - self.first.system_seconds) / self.seconds)

    def allowed_cpus(self) -> float | None:
        limits, host = self.last.limits, self.last.host
        allowed = limits.allowed_cpus if limits is not None else None
        if allowed is None and host is not None:
            allowed = host.logical_cpus
        return allowed

    # The probe's figures between the window's first and last samples.

    def probes(self) -> tuple[ProbeSample, ProbeSample] | None:
        first, last = self.first.probe, self.last.probe
        if first is None or last is None or first.pid != last.pid:
            return None
        return first, last

    def steady_steps(self) -> int:
        probes = self.probes()
        return 0 if probes is None else probes[1].steady_steps - probes[0].steady_steps

    def phase_seconds(self) -> tuple[dict[str, float], float] | None:
        """Seconds per phase, and steady step time, over the window's steps."""
        probes = self.probes()
        if probes is None or self.steady_steps() < MIN_WINDOW_STEPS:
            return None
        before, after = dict(probes[0].phase_seconds), dict(probes[1].phase_seconds)
        phases = {phase: seconds - before.get(phase, 0.0) for phase, seconds in after.items()}
        return phases, probes[1].step_seconds_sum - probes[0].step_seconds_sum

    def step_split(self) -> tuple[dict[str, float], float] | None:
        """``phase_seconds()``, only when every phase of SPLIT_PHASES (or, for a
        compiled train step, of COMPILED_SPLIT_PHASES) was measured in the window
        and the probe says its latest step was split (not "backward not seen", "not
        split: compiled graph"; a probe too old to say is taken at its phases)."""
        split = self.phase_seconds()
        if split is None or not any(all(split[0].get(p, 0.0) > 0 for p in phases)
                                    for phases in (SPLIT_PHASES, COMPILED_SPLIT_PHASES)):
            return None
        said = self.last.probe.phase_split if self.last.probe is not None else None
        return split if said in (None, SPLIT) else None

    def in_process_group(self) -> bool:
        """The job is one rank of several (torch.distributed, a TF cluster)."""
        group = self.settings().get("process_group", NO_PROCESS_GROUP)
        return group != NO_PROCESS_GROUP

    def exchange_measured(self) -> bool:
        """The window's full step split has the rank's waits in collectives as
        their own phase, ``exchange``, so that they are not in ``other``."""
        split = self.step_split()
        return split is not None and split[0].get(EXCHANGE_PHASE, 0.0) > 0

    def exchange_unmeasured(self) -> bool:
        """A rank of several whose time in collectives the window did not
        measure: that time is in ``other`` (or ``unsplit``), exactly where time
        waiting for input would be."""
        return self.in_process_group() and not self.exchange_measured()

    def kernel_seconds(self) -> dict[str, float] | None:
        """GPU seconds per kernel name over the window, None without kernel records.
        Shared by every rule that asks: read it, never change it."""
        if not self._kernel_seconds:
            self._kernel_seconds.append(self._spent_per_kernel())
        return self._kernel_seconds[0]

    def _spent_per_kernel(self) -> dict[str, float] | None:
        probes = self.probes()
        if probes is None:
            return None
        before_kernels, after_kernels = probes[0].kernels, probes[1].kernels
        if after_kernels is None or not after_kernels.traced or before_kernels is None:
            return None
        if after_kernels is before_kernels:  # a probe read less often: nothing new
            return None
        before = {(r.kernel, r.device): r.seconds for r in before_kernels.kernels}
        spent: dict[str, float] = {}
        for row in after_kernels.kernels:
            delta = row.seconds - before.get((row.kernel, row.device), 0.0)
            if delta > 0:
                spent[row.kernel] = spent.get(row.kernel, 0.0) + delta
        return spent if sum(spent.values()) > 0 else None

    def settings(self) -> dict[str, str]:
        probe = self.last.probe
        merged: dict[str, str] = {}
        for _, values in probe.settings if probe is not None else ():
            merged.update(values)
        return merged

    # NVML, for the devices the job is on.

    def gpu_utilization(self) -> float | None:
        """Mean over the window of the job's SM share (or its devices' utilization)."""
        values = []
        for point in self.points:
            gpu = point.gpu
            if gpu is None or not gpu.available:
                continue
            mine = [p for p in gpu.processes if p.pid in point.pids]
            shares = [p.sm_utilization_ratio for p in mine if p.sm_utilization_ratio is not None]
            if shares:
                values.append(_mean(shares))
                continue
            indexes = {p.gpu_index for p in mine}
            devices = [d.utilization_ratio for d in gpu.devices
                       if d.index in indexes and d.utilization_ratio is not None]
            if devices:
                values.append(_mean(devices))
        return _mean(values) if values else None

    def job_gpus(self) -> list[tuple[str, int | None, int | None]]:
        """(name, memory used, memory total) of each device the job holds memory on."""
        gpu = self.last.gpu
        if gpu is None or not gpu.available:
            return []
        indexes = {p.gpu_index for p in gpu.processes if p.pid in self.last.pids}
        return [(d.name, d.memory_used_bytes, d.memory_total_bytes)
                for d in gpu.devices if d.index in indexes and d.up]


def point_of(snapshot: Snapshot, *, host: HostSample | None = None,
             gpu: GpuSample | None = None) -> Point:
    ps = snapshot.processes
    runnable = [p.runnable_threads for p in ps]
    target = snapshot.target
    agent: AgentSelfSample | None = snapshot.agent
    return Point(
        seconds=snapshot.monotonic_seconds,
        user_seconds=sum(p.user_seconds for p in ps),
        system_seconds=sum(p.system_seconds for p in ps),
        iowait_seconds=sum(p.iowait_seconds for p in ps),
        target_busy_seconds=(target.user_seconds + target.system_seconds
                             if target is not None else 0.0),
        involuntary_switches=sum(p.involuntary_context_switches for p in ps),
        main_wait_seconds=target.main_thread_wait_seconds if target is not None else None,
        main_run_seconds=target.main_thread_run_seconds if target is not None else None,
        runnable_threads=(None if not ps or any(r is None for r in runnable)
                          else sum(r for r in runnable if r is not None)),
        rss_bytes=sum(p.rss_bytes for p in ps),
        host=host if host is not None else snapshot.host,
        gpu=gpu if gpu is not None else snapshot.gpu,
        limits=snapshot.limits, probe=snapshot.probe,
        agent_cpu_seconds=agent.cpu_seconds if agent is not None else None,
        pids=frozenset(p.pid for p in ps))
