"""The one snapshot builder that attach and daemon share: failures are counted in
one place and logged once per target and collector, the pass is timed on an
injected clock, and an exited target leaves the pass. Targets are real child
processes; only the failing collectors are stand-ins."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dlprof_agent.agent.core import Agent, AgentOptions, OneTarget
from dlprof_agent.agent.discovery import DaemonOptions, Discovery
from dlprof_agent.agent.loop import StopRequested
from dlprof_agent.agent.snapshot_builder import (
    SnapshotBuilder,
    TargetReaders,
    error_log,
    target_snapshot,
)
from dlprof_agent.collectors.gpu import GpuCollector
from dlprof_agent.collectors.host import HostCollector, HostSample
from dlprof_agent.collectors.limits import LimitsCollector, LimitsSample
from dlprof_agent.collectors.nvml import Nvml
from dlprof_agent.collectors.process import ProcessCollector, ProcessSample
from dlprof_agent.collectors.target import Target
from dlprof_agent.model.findings.tracker import FindingsTracker
from dlprof_agent.model.snapshot import AgentSelfSample
from dlprof_agent.probe_link.samples import ProbeSample
from tests.fake_nvml import FakeDevice, FakeNvml, ProcessInfo

# The sleepers carry a marker of this worker: tests of this file run on
# several workers at once, and a scan by a shared marker found another worker's.
MARKER = f"dlprof-snapshot-builder-test-{os.getpid()}"


class SteppingClock:
    """A clock that moves ``step`` seconds each time it is read."""

    def __init__(self, start: float, step: float) -> None:
        self.now, self.step = start, step

    def __call__(self) -> float:
        now = self.now
        self.now += self.step
        return now


class LostProbe:
    """A probe channel whose every read fails, as a probe whose socket broke."""

    up = False

    def sample(self) -> ProbeSample | None:
        raise ConnectionResetError("the probe's socket closed")


class DeniedProcesses:
    def sample(self) -> tuple[ProcessSample, ...]:
        raise PermissionError("stat of the target denied")


class BrokenHost:
    def sample(self) -> HostSample:
        raise OSError("no host statistics")


class DeniedLimits:
    def sample(self) -> LimitsSample:
        raise PermissionError("limits denied")


@pytest.fixture
def spawn_sleeper() -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def spawn() -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            [sys.executable, "-c", f"import time; time.sleep(120)  # {MARKER}"])
        started.append(process)
        return process

    yield spawn
    for process in started:
        process.kill()
        process.wait()


def readers(pid: int, **changes: Any) -> TargetReaders:
    """The real readers of ``pid``, with ``changes`` in their place."""
    real = TargetReaders(pid, ProcessCollector(Target.of(pid),
                                               errors=error_log(gpu=False, probe=False)),
                         limits=LimitsCollector(Target.of(pid)))
    return dataclasses.replace(real, **changes)


def builder(errors_probe: bool = True, host: HostCollector | BrokenHost | None = None,
            clock: Callable[[], float] | None = None) -> SnapshotBuilder:
    return SnapshotBuilder(host=host or HostCollector(), gpu=None,
                           errors=error_log(gpu=False, probe=errors_probe),
                           clock=clock or SteppingClock(100.0, 0.25),
                           wall_clock=lambda: 1_700_000_000.0)


def test_a_failing_collector_is_counted_every_pass_and_logged_once_per_target(
        spawn_sleeper: Callable[[], subprocess.Popen[bytes]],
        caplog: pytest.LogCaptureFixture) -> None:
    first, second = spawn_sleeper(), spawn_sleeper()
    build = builder()
    targets = [readers(p.pid, probe=LostProbe()) for p in (first, second)]
    with caplog.at_level(logging.WARNING, logger="dlprof_agent"):
        for _ in range(3):
            node = build.build(targets)
    assert dict(node.collector_errors) == {"process": 0, "host": 0, "probe": 6, "identity": 0}
    # The other collectors still publish, for both targets.
    assert node.host is not None
    assert [s.target_pid for s in node.targets] == [first.pid, second.pid]
    for snapshot in node.targets:
        assert snapshot.target is not None and snapshot.limits is not None
        assert snapshot.probe is None and not snapshot.probe_up
    lines = [r for r in caplog.records if "probe collector" in r.getMessage()]
    assert sorted(re.search(r"pid (\d+)", r.getMessage()).group(1)  # type: ignore[union-attr]
                  for r in lines) == sorted([str(first.pid), str(second.pid)])
    assert all(r.exc_info is None and "Traceback" not in r.getMessage() for r in lines)


def test_each_collector_is_counted_under_its_own_name(
        spawn_sleeper: Callable[[], subprocess.Popen[bytes]]) -> None:
    sleeper = spawn_sleeper()
    build = builder(host=BrokenHost())
    node = build.build([readers(sleeper.pid, processes=DeniedProcesses(),
                                limits=DeniedLimits())])
    # A denied process read keeps the target, with no process series.
    assert [s.target_pid for s in node.targets] == [sleeper.pid]
    assert node.targets[0].processes == () and node.targets[0].limits is None
    assert node.host is None
    # Limits are read from the target's /proc tree: counted with the processes.
    assert dict(node.collector_errors) == {"process": 2, "host": 1, "probe": 0, "identity": 0}


def test_the_pass_is_timed_on_the_injected_clocks(
        spawn_sleeper: Callable[[], subprocess.Popen[bytes]]) -> None:
    sleeper = spawn_sleeper()
    build = builder(clock=SteppingClock(100.0, 0.25))
    first = build.build([readers(sleeper.pid)])
    second = build.build([readers(sleeper.pid)])
    # One reading when the pass starts and one when it ends: 0.25 s apart.
    assert (first.monotonic_seconds, first.sample_duration_seconds) == (100.0, 0.25)
    assert (second.monotonic_seconds, second.sample_duration_seconds) == (100.5, 0.25)
    assert first.timestamp_seconds == 1_700_000_000.0
    assert second.targets[0].monotonic_seconds == 100.5
    assert (first.samples_total, second.samples_total) == (1, 2)


def test_a_given_start_times_the_work_done_before_the_pass(
        spawn_sleeper: Callable[[], subprocess.Popen[bytes]]) -> None:
    sleeper = spawn_sleeper()
    clock = SteppingClock(10.0, 1.0)
    build = builder(clock=clock)
    started = build.start()
    clock()  # finding the targets took a reading of the clock: one second
    node = build.build([readers(sleeper.pid)], started=started)
    assert (node.monotonic_seconds, node.sample_duration_seconds) == (10.0, 2.0)


def test_a_target_that_exits_leaves_the_pass_and_the_others_stay(
        spawn_sleeper: Callable[[], subprocess.Popen[bytes]]) -> None:
    leaving, staying = spawn_sleeper(), spawn_sleeper()
    build = builder()
    targets = [readers(p.pid) for p in (leaving, staying)]
    assert len(build.build(targets).targets) == 2
    leaving.kill()
    leaving.wait()
    node = build.build(targets)
    assert [s.target_pid for s in node.targets] == [staying.pid]
    assert dict(node.collector_errors)["process"] == 0  # an exit is no failure


def test_attach_sees_its_target_with_the_node_and_down_once_it_left_the_pass(
        spawn_sleeper: Callable[[], subprocess.Popen[bytes]]) -> None:
    sleeper = spawn_sleeper()
    build = builder()
    node = build.build([readers(sleeper.pid, probe=LostProbe())])
    mine = target_snapshot(node, sleeper.pid)
    assert mine.target_up and mine.target is not None and mine.host is node.host
    assert mine.collector_errors == node.collector_errors and mine.samples_total == 1
    gone = target_snapshot(build.build([]), sleeper.pid)
    assert not gone.target_up and gone.processes == () and gone.host is not None
    assert gone.samples_total == 2 and dict(gone.collector_errors)["probe"] == 1


def test_a_stop_request_inside_a_read_is_not_swallowed(
        spawn_sleeper: Callable[[], subprocess.Popen[bytes]]) -> None:
    sleeper = spawn_sleeper()

    class Stopping:
        up = True

        def sample(self) -> ProbeSample | None:
            raise StopRequested

    build = builder()
    with pytest.raises(StopRequested):
        build.build([readers(sleeper.pid, probe=Stopping())])
    assert dict(build.errors.counts())["probe"] == 0


def test_the_agent_footprint_is_read_once_per_pass(
        spawn_sleeper: Callable[[], subprocess.Popen[bytes]]) -> None:
    first, second = spawn_sleeper(), spawn_sleeper()
    reads: list[AgentSelfSample] = []

    def read_self() -> AgentSelfSample:
        reads.append(AgentSelfSample.read())
        return reads[-1]

    build = SnapshotBuilder(host=HostCollector(), gpu=None, errors=error_log(gpu=False,
                            probe=False), agent_self=read_self)
    node = build.build([readers(first.pid), readers(second.pid)])
    assert len(reads) == 1
    assert node.agent is reads[0] and all(s.agent is reads[0] for s in node.targets)


def test_findings_are_judged_per_target_on_the_node_it_runs_on(
        spawn_sleeper: Callable[[], subprocess.Popen[bytes]]) -> None:
    sleeper = spawn_sleeper()
    build = builder(clock=SteppingClock(0.0, 0.5))
    tracker = FindingsTracker()
    target = readers(sleeper.pid, findings=tracker)
    # A window of passes, on the injected clock: no sleeping for the rules.
    nodes = [build.build([target]) for _ in range(40)]
    judged = {f.id: f.active for f in nodes[-1].targets[0].findings}
    assert judged.get("memory_near_limit") is False  # a sleeper is far from any limit
    untracked = build.build([readers(sleeper.pid)])
    assert untracked.targets[0].findings == ()


def test_attach_s_core_stops_reading_its_one_target_once_it_exited(
        spawn_sleeper: Callable[[], subprocess.Popen[bytes]]) -> None:
    sleeper = spawn_sleeper()
    errors = error_log(gpu=False, probe=False)
    agent = Agent(AgentOptions(interval=1.0, gpu=False), chooser=OneTarget(Target.of(sleeper.pid)),
                  host=HostCollector(), gpu=None, errors=errors,
                  clock=SteppingClock(5.0, 0.125))
    up = target_snapshot(agent.sample_once(), sleeper.pid)
    assert up.target_up and up.sample_duration_seconds == 0.125 and up.host is not None
    sleeper.kill()
    sleeper.wait()
    down = target_snapshot(agent.sample_once(), sleeper.pid)
    assert not down.target_up and down.processes == () and down.host is not None
    assert agent.targets == {}  # never read again, nor chosen again
    again = agent.sample_once()
    assert not target_snapshot(again, sleeper.pid).target_up
    assert dict(again.collector_errors)["process"] == 0
    assert agent.latest is again and again.samples_total == 3


def test_the_daemon_finds_its_target_and_drops_it_in_the_pass_it_exits(
        spawn_sleeper: Callable[[], subprocess.Popen[bytes]]) -> None:
    sleeper = spawn_sleeper()
    options = DaemonOptions(interval=1.0, scan_interval=10.0,
                            matches=(re.compile(re.escape(MARKER)),), gpu=False)
    clock = SteppingClock(0.0, 0.25)
    daemon = Agent(options, chooser=Discovery(options, socket_dirs=()),
                   host=HostCollector(), gpu=None, errors=error_log(gpu=False, probe=False),
                   clock=clock)
    node = daemon.sample_once()
    assert [s.target_pid for s in node.targets] == [sleeper.pid]
    assert node.sample_duration_seconds == 0.25 and node.host is not None
    sleeper.kill()
    sleeper.wait()
    node = daemon.sample_once()
    assert daemon.targets == {}
    # Dropped in that pass, and served down, with its last totals, through the grace.
    assert [(s.target_pid, s.target_up) for s in node.targets] == [(sleeper.pid, False)]
    assert dict(node.collector_errors) == {"process": 0, "host": 0, "identity": 0}
    assert daemon.latest is node and node.samples_total == 2


def test_a_process_on_a_gpu_becomes_a_daemon_target_with_its_gpu_series(
        spawn_sleeper: Callable[[], subprocess.Popen[bytes]]) -> None:
    # NVML (the stand-in: no GPU here) lists a real process as resident on a GPU:
    # the pass's GPU read tells the daemon's next scan about it.
    sleeper, bystander = spawn_sleeper(), spawn_sleeper()
    fake = FakeNvml([FakeDevice(compute_processes=[ProcessInfo(sleeper.pid, 1 << 30)])])
    errors = error_log(gpu=True, probe=False)
    options = DaemonOptions(interval=1.0, scan_interval=0.1, gpu=True)
    daemon = Agent(options, chooser=Discovery(options, socket_dirs=()),
                   host=HostCollector(), errors=errors,
                   gpu=GpuCollector(nvml=Nvml(lib=fake), errors=errors, clock=lambda: 0.0),
                   clock=SteppingClock(0.0, 0.25))
    first = daemon.sample_once()
    assert first.targets == () and first.gpu is not None
    assert sleeper.pid in first.gpu.resident_pids
    second = daemon.sample_once()
    assert [s.target_pid for s in second.targets] == [sleeper.pid]
    assert daemon.targets[sleeper.pid].reason == "gpu"
    assert second.gpu is not None
    assert [(p.pid, p.memory_bytes) for p in second.gpu.processes] == [(sleeper.pid, 1 << 30)]
    assert bystander.pid not in daemon.targets
    assert dict(second.collector_errors)["gpu"] == 0
