"""The agent's core watching one target, as `attach` runs it: failures are
contained per collector, the target's exit ends the loop, and the agent measures
its own footprint."""

from __future__ import annotations

import subprocess
import threading

import pytest

from dlprof_agent.agent.core import Agent, AgentOptions, OneTarget
from dlprof_agent.agent.snapshot_builder import target_snapshot
from dlprof_agent.collectors.error_log import ErrorLog
from dlprof_agent.collectors.host import HostCollector, HostSample
from dlprof_agent.collectors.target import Target
from dlprof_agent.model.snapshot import NodeSnapshot, Snapshot
from tests.helpers import wait_until


class BrokenHost(HostCollector):
    def sample(self) -> HostSample:
        raise OSError("no /proc/stat")


class OneJob:
    """The core with ``pid`` as its one target, and that target's part of each pass."""

    def __init__(self, pid: int, errors: ErrorLog, host: HostCollector | None = None) -> None:
        self.pid = pid
        self.agent = Agent(AgentOptions(interval=0.05, gpu=False),
                           chooser=OneTarget(Target.of(pid)), host=host or HostCollector(),
                           gpu=None, errors=errors)

    def sample_once(self) -> Snapshot:
        return target_snapshot(self.agent.sample_once(), self.pid)

    def run(self, stop: threading.Event, seen: list[Snapshot]) -> None:
        def on_pass(node: NodeSnapshot) -> bool:
            seen.append(target_snapshot(node, self.pid))
            return seen[-1].target_up

        self.agent.run(stop, on_pass)


def make_sampler(pid: int, errors: ErrorLog, host: HostCollector | None = None) -> OneJob:
    return OneJob(pid, errors, host)


def test_a_failing_collector_is_counted_and_the_others_still_publish(
        python_sleeper: subprocess.Popen[bytes]) -> None:
    errors = ErrorLog(("process", "host"))
    sampler = make_sampler(python_sleeper.pid, errors, host=BrokenHost())
    first = sampler.sample_once()
    second = sampler.sample_once()
    assert first.host is None and second.host is None
    assert [p.pid for p in second.processes] == [python_sleeper.pid]
    assert dict(second.collector_errors) == {"process": 0, "host": 2}
    assert second.samples_total == 2
    assert sampler.agent.latest is not None
    assert target_snapshot(sampler.agent.latest, python_sleeper.pid) == second


def test_the_loop_ends_with_target_down_when_the_target_exits(
        python_sleeper: subprocess.Popen[bytes]) -> None:
    sampler = make_sampler(python_sleeper.pid, ErrorLog())
    seen: list[Snapshot] = []
    loop = threading.Thread(target=sampler.run, args=(threading.Event(), seen))
    loop.start()
    wait_until(lambda: seen, 10, what="the loop's first pass")
    python_sleeper.kill()
    python_sleeper.wait()
    loop.join(5)
    assert not loop.is_alive()
    assert seen[0].target_up and seen[0].target is not None
    assert not seen[-1].target_up and seen[-1].processes == ()
    assert sum(1 for s in seen if not s.target_up) == 1


@pytest.mark.slow  # passes of a real sampler, counted over their own span
def test_the_loop_keeps_to_its_interval_and_stops_on_request(
        python_sleeper: subprocess.Popen[bytes]) -> None:
    sampler = make_sampler(python_sleeper.pid, ErrorLog())
    stop = threading.Event()
    seen: list[Snapshot] = []
    loop = threading.Thread(target=sampler.run, args=(stop, seen))
    loop.start()
    wait_until(lambda: len(seen) >= 10, 30, what="ten passes")
    stop.set()
    loop.join(5)
    assert not loop.is_alive()
    # Deadlines are multiples of the 0.05 s interval: a pass made late by the machine's
    # load delays only itself, and missed ticks are skipped, never caught up in a
    # burst. So the passes never outnumber the intervals they span (plus one for the
    # jitter of the moment within a pass that a snapshot is stamped).
    times = [snapshot.monotonic_seconds for snapshot in seen]
    assert times == sorted(times)
    assert len(times) - 1 <= (times[-1] - times[0]) / 0.05 + 1


def test_the_agent_reports_its_own_footprint(python_sleeper: subprocess.Popen[bytes]) -> None:
    snapshot = make_sampler(python_sleeper.pid, ErrorLog()).sample_once()
    assert snapshot.agent is not None
    assert snapshot.agent.cpu_seconds > 0
    assert 0 < snapshot.agent.rss_bytes <= snapshot.agent.rss_peak_bytes


def test_a_stop_signal_landing_in_a_guarded_read_ends_the_loop(
        python_sleeper: subprocess.Popen[bytes]) -> None:
    # The SIGTERM handler raises its stop exception wherever the main thread is,
    # often inside a collector read whose failures are counted and swallowed.
    from dlprof_agent.agent.loop import StopRequested

    class StoppedHost(HostCollector):
        def sample(self) -> HostSample:
            raise StopRequested

    errors = ErrorLog()
    with pytest.raises(StopRequested):
        make_sampler(python_sleeper.pid, errors, host=StoppedHost()).sample_once()
    assert errors.counts() == {}
