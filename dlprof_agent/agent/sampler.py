"""The sampling loop: reads every collector once per interval, on the agent's own
clock, and publishes one immutable snapshot. Scrapes only read the latest one."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar

from dlprof_agent.agent.findings.tracker import FindingsTracker
from dlprof_agent.agent.findings.window import point_of
from dlprof_agent.collectors.error_log import ErrorLog
from dlprof_agent.collectors.gpu_samples import GpuSample
from dlprof_agent.collectors.host import HostCollector
from dlprof_agent.collectors.limits import LimitsCollector
from dlprof_agent.collectors.probe import ProbeSample
from dlprof_agent.collectors.process import ProcessCollector, ProcessSample
from dlprof_agent.errors import TargetGone
from dlprof_agent.model.snapshot import AgentSelfSample, Snapshot

log = logging.getLogger("dlprof_agent")


_T = TypeVar("_T")
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


class GpuSource(Protocol):
    """What the sampler needs from the GPU collector."""

    def sample(self, pids: frozenset[int]) -> GpuSample: ...


class ProbeSource(Protocol):
    """What the sampler needs from the in-process probe's channel."""

    @property
    def up(self) -> bool: ...

    def sample(self) -> ProbeSample | None: ...


@dataclass
class Sampler:
    target_pid: int
    processes: ProcessCollector
    host: HostCollector
    gpu: GpuSource | None
    errors: ErrorLog
    interval_seconds: float
    probe: ProbeSource | None = None
    limits: LimitsCollector | None = None
    findings: FindingsTracker | None = None
    _latest: Snapshot | None = field(default=None, init=False)
    _samples_total: int = field(default=0, init=False)
    _target_up: bool = field(default=True, init=False)

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
            except Exception as error:
                self.errors.record("process", error)
        host = self._guarded("host", self.host.sample)
        gpu = None
        if self.gpu is not None:
            pids = frozenset(p.pid for p in processes)
            gpu_source = self.gpu
            gpu = self._guarded("gpu", lambda: gpu_source.sample(pids))
        probe = None
        if self.probe is not None and self._target_up:
            probe = self._guarded("probe", self.probe.sample)
        limits = None
        if self.limits is not None and self._target_up:
            limits = self._guarded("process", self.limits.sample)
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
            probe=probe,
            probe_up=probe is not None,
            limits=limits,
        )
        if self.findings is not None and self._target_up:
            snapshot = replace(snapshot, findings=self.findings.update(point_of(snapshot)))
        self._latest = snapshot  # one reference swap: readers never see a half-built state
        return snapshot

    def _guarded(self, collector: str, read: Callable[[], _T]) -> _T | None:
        try:
            return read()
        except Exception as error:
            self.errors.record(collector, error)
            return None

    def run(self, stop: threading.Event, on_sample: Callable[[Snapshot], None]) -> None:
        """Sample every interval until ``stop`` is set or the target exits.

        Deadlines are fixed multiples of the interval, so a slow pass delays
        the next one without shifting the ones after it.
        """
        next_deadline = time.monotonic()
        while not stop.is_set():
            snapshot = self.sample_once()
            on_sample(snapshot)
            if not snapshot.target_up:
                return
            next_deadline += self.interval_seconds
            now = time.monotonic()
            if next_deadline < now:  # overran: skip the missed ticks
                missed = int((now - next_deadline) // self.interval_seconds) + 1
                next_deadline += missed * self.interval_seconds
            stop.wait(next_deadline - now)
