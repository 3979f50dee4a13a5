"""The sampling loop: reads every collector once per interval, on the agent's own
clock, and publishes one immutable snapshot. Scrapes only read the latest one."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from dlprof_agent.agent.exit_totals import final_probe_totals
from dlprof_agent.agent.findings.tracker import FindingsTracker
from dlprof_agent.agent.findings.window import point_of
from dlprof_agent.agent.loop import guarded, run_on_deadlines
from dlprof_agent.collectors.error_log import ErrorLog
from dlprof_agent.collectors.gpu_samples import GpuSample
from dlprof_agent.collectors.host import HostCollector
from dlprof_agent.collectors.limits import LimitsCollector
from dlprof_agent.collectors.probe_samples import ProbeSample
from dlprof_agent.collectors.process import ProcessCollector, ProcessSample
from dlprof_agent.errors import TargetGone
from dlprof_agent.model.snapshot import AgentSelfSample, Snapshot


class GpuReader(Protocol):
    """What the sampler needs from the GPU collector."""

    def sample(self, pids: frozenset[int]) -> GpuSample: ...


class ProbeReader(Protocol):
    """What the sampler needs from the in-process probe's channel."""

    @property
    def up(self) -> bool: ...

    def sample(self) -> ProbeSample | None: ...

    def final_sample(self) -> ProbeSample | None: ...


@dataclass
class Sampler:
    target_pid: int
    processes: ProcessCollector
    host: HostCollector
    gpu: GpuReader | None
    errors: ErrorLog
    interval_seconds: float
    probe: ProbeReader | None = None
    limits: LimitsCollector | None = None
    findings: FindingsTracker | None = None
    _latest: Snapshot | None = field(default=None, init=False)
    _samples_total: int = field(default=0, init=False)
    _target_up: bool = field(default=True, init=False)
    _last_probe: ProbeSample | None = field(default=None, init=False)

    @property
    def latest(self) -> Snapshot | None:
        return self._latest

    def sample_once(self) -> Snapshot:
        """One pass over every collector. A failing collector is counted and
        its series are left out of this snapshot; the others still publish."""
        started_wall = time.time()
        started = time.monotonic()
        processes: tuple[ProcessSample, ...] = ()
        if self._target_up:
            try:
                processes = self.processes.sample()
            except TargetGone:
                self._target_up = False
                self._last_probe = final_probe_totals(self.probe, self._last_probe,
                                                      self.errors)
            except Exception as error:
                self.errors.record("process", error)
        host = guarded(self.errors, "host", self.host.sample)
        gpu = None
        if self.gpu is not None:
            pids = frozenset(p.pid for p in processes)
            gpu_source = self.gpu
            gpu = guarded(self.errors, "gpu", lambda: gpu_source.sample(pids))
        probe = None
        if self.probe is not None and self._target_up:
            probe = guarded(self.errors, "probe", self.probe.sample)
            self._last_probe = probe or self._last_probe
        limits = None
        if self.limits is not None and self._target_up:
            limits = guarded(self.errors, "process", self.limits.sample)
        self._samples_total += 1
        snapshot = Snapshot(
            timestamp_seconds=started_wall,
            monotonic_seconds=started,
            target_pid=self.target_pid,
            target_up=self._target_up,
            processes=processes,
            host=host,
            gpu=gpu,
            collector_errors=tuple(sorted(self.errors.counts().items())),
            sample_duration_seconds=time.monotonic() - started,
            samples_total=self._samples_total,
            agent=AgentSelfSample.read(),
            # Once the target has gone its probe's last totals stay, beside target_up 0,
            # so that a scrape in the grace period sees every step.
            probe=probe if self._target_up else self._last_probe,
            probe_up=probe is not None,
            limits=limits,
        )
        if self.findings is not None and self._target_up:
            snapshot = replace(snapshot, findings=self.findings.update(point_of(snapshot)))
        self._latest = snapshot  # one reference swap: readers never see a half-built state
        return snapshot

    def run(self, stop: threading.Event, on_sample: Callable[[Snapshot], None]) -> None:
        """Sample every interval, on fixed deadlines, until ``stop`` is set or the
        target exits."""

        def one_pass() -> bool:
            snapshot = self.sample_once()
            on_sample(snapshot)
            return snapshot.target_up

        run_on_deadlines(stop, self.interval_seconds, one_pass)
