"""The sampling loop of `attach`: one target, a pass (snapshot_builder) every
interval on the agent's own clock, and one immutable snapshot published. Scrapes
only read the latest one."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from dlprof_agent.agent.exit_totals import final_probe_totals
from dlprof_agent.agent.loop import run_on_deadlines
from dlprof_agent.agent.snapshot_builder import (
    PROBE_DEADLINE_SECONDS,
    GpuReader,
    HostReader,
    LimitsReader,
    ProbeReader,
    ProcessReader,
    SnapshotBuilder,
    TargetReaders,
    target_snapshot,
)
from dlprof_agent.collectors.error_log import ErrorLog
from dlprof_agent.collectors.identity import Identity
from dlprof_agent.model.findings.tracker import FindingsTracker
from dlprof_agent.model.snapshot import Snapshot
from dlprof_agent.probe_link.samples import ProbeSample
from dlprof_agent.probe_link.series_budget import SeriesBudget


@dataclass
class Sampler:
    """One target, given by its pid; the pass itself is the SnapshotBuilder's."""

    target_pid: int
    processes: ProcessReader
    host: HostReader
    gpu: GpuReader | None
    errors: ErrorLog
    interval_seconds: float
    probe: ProbeReader | None = None  # set once the probe's channel is open
    limits: LimitsReader | None = None
    findings: FindingsTracker | None = None
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], float] = time.time
    budget: SeriesBudget | None = None  # folds the probe's rows past the series budget
    probe_deadline_seconds: float = PROBE_DEADLINE_SECONDS  # a pass's wait for the probe
    node_name: str = ""  # dlprof_target_info's node
    _latest: Snapshot | None = field(default=None, init=False)
    _target_up: bool = field(default=True, init=False)
    _builder: SnapshotBuilder = field(init=False)
    _last_probe: ProbeSample | None = field(default=None, init=False)
    _last_identity: Identity | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._builder = SnapshotBuilder(host=self.host, gpu=self.gpu, errors=self.errors,
                                        clock=self.clock, wall_clock=self.wall_clock,
                                        budget=self.budget,
                                        probe_deadline_seconds=self.probe_deadline_seconds,
                                        node_name=self.node_name)

    @property
    def latest(self) -> Snapshot | None:
        return self._latest

    def sample_once(self) -> Snapshot:
        """One pass. A failing collector is counted and its series are left out of
        this snapshot; the others still publish. Once the target has exited, the
        host and GPUs are still read, with the target down."""
        targets = [TargetReaders(self.target_pid, self.processes, limits=self.limits,
                                 probe=self.probe, findings=self.findings)
                   ] if self._target_up else []
        snapshot = target_snapshot(self._builder.build(targets), self.target_pid)
        was_up, self._target_up = self._target_up, snapshot.target_up
        if snapshot.target_up:
            self._last_probe = snapshot.probe or self._last_probe
            self._last_identity = snapshot.identity or self._last_identity
        else:
            if was_up:  # the reply to the last read, if it came after the exit
                self._last_probe = final_probe_totals(self.probe, self._last_probe,
                                                      self.errors)
            # Its probe's last totals stay beside target_up 0, so that a scrape in
            # the grace period sees every step.
            snapshot = replace(snapshot, probe=self._last_probe, identity=self._last_identity)
        self._latest = snapshot  # one reference swap: readers never see a half-built state
        return snapshot

    def close(self) -> None:
        """No more probe reads; one in progress ends within its deadline."""
        self._builder.close()

    def run(self, stop: threading.Event, on_sample: Callable[[Snapshot], None]) -> None:
        """Sample every interval, on fixed deadlines, until ``stop`` is set or the
        target exits."""

        def one_pass() -> bool:
            snapshot = self.sample_once()
            on_sample(snapshot)
            return snapshot.target_up

        run_on_deadlines(stop, self.interval_seconds, one_pass, self.clock)
