"""The data model: one immutable snapshot per sampling pass, for one target
(``Snapshot``) or for a node and its targets (``NodeSnapshot``). The sampling
loops build them; exporters, the status line and findings read them."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

from dlprof_agent.collectors.gpu_samples import GpuSample
from dlprof_agent.collectors.host import HostSample
from dlprof_agent.collectors.identity import Identity
from dlprof_agent.collectors.limits import LimitsSample
from dlprof_agent.collectors.process import ProcessSample
from dlprof_agent.collectors.procfs import read_self_statm_rss_bytes
from dlprof_agent.model.findings.catalogue import Finding
from dlprof_agent.probe_link.samples import ProbeSample


@dataclass(frozen=True, slots=True)
class AgentSelfSample:
    """The agent's own footprint, read with system calls rather than /proc files
    so that measuring it costs next to nothing."""

    cpu_seconds: float
    rss_bytes: int
    rss_peak_bytes: int

    @classmethod
    def read(cls) -> AgentSelfSample:
        times = os.times()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        rss = read_self_statm_rss_bytes()
        if rss is None:
            rss = peak
        # The kernel updates the high-water mark lazily; the current value can be ahead.
        return cls(times.user + times.system, rss, max(peak, rss))


@dataclass(frozen=True, slots=True)
class Snapshot:
    timestamp_seconds: float  # unix time the pass started
    monotonic_seconds: float
    target_pid: int
    target_up: bool
    processes: tuple[ProcessSample, ...] = ()
    host: HostSample | None = None
    gpu: GpuSample | None = None
    collector_errors: tuple[tuple[str, int], ...] = ()
    sample_duration_seconds: float = 0.0
    samples_total: int = 0
    agent: AgentSelfSample | None = None
    series_dropped: tuple[tuple[str, int], ...] = ()  # (reason, series left out so far)
    probe: ProbeSample | None = None
    probe_up: bool = False
    probe_stale: bool = False  # `probe` is the last good sample: this pass's read missed
    probe_misses: int = 0  # probe reads so far that missed their deadline
    limits: LimitsSample | None = None
    findings: tuple[Finding, ...] = ()  # every rule that could judge this pass
    identity: Identity | None = None  # its job, rank, node and pod; None: not read

    @property
    def target(self) -> ProcessSample | None:
        return next((p for p in self.processes if p.is_target), None)


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """One pass of the agent: the node's host and GPUs read once, and a Snapshot
    per target (without host and GPU) for the processes it watches."""

    timestamp_seconds: float
    monotonic_seconds: float
    host: HostSample | None
    gpu: GpuSample | None
    targets: tuple[Snapshot, ...]
    collector_errors: tuple[tuple[str, int], ...] = ()
    sample_duration_seconds: float = 0.0
    samples_total: int = 0
    agent: AgentSelfSample | None = None
    series_dropped: tuple[tuple[str, int], ...] = ()  # (reason, series left out so far)

    @classmethod
    def of_one(cls, snapshot: Snapshot) -> NodeSnapshot:
        """The pass that holds ``snapshot`` alone, with its host, GPUs and agent
        figures (what `snapshot_builder.target_snapshot` takes apart)."""
        return cls(timestamp_seconds=snapshot.timestamp_seconds,
                   monotonic_seconds=snapshot.monotonic_seconds, host=snapshot.host,
                   gpu=snapshot.gpu, targets=(snapshot,),
                   collector_errors=snapshot.collector_errors,
                   sample_duration_seconds=snapshot.sample_duration_seconds,
                   samples_total=snapshot.samples_total, agent=snapshot.agent,
                   series_dropped=snapshot.series_dropped)
