"""One target never delays another: a probe exchange has a deadline for the
whole of it, however the probe spreads its bytes; every target's probe is read
at once; a read that misses its deadline keeps the last good sample, marked
stale and counted; a reply that trickles pass after pass drops the probe, which
is reached again after a growing pause; the status page says which and why."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import pytest

from dlprof_agent.agent.core import Agent, OneTarget, TargetWatch
from dlprof_agent.agent.discovery import DaemonOptions
from dlprof_agent.agent.snapshot_builder import SnapshotBuilder, TargetReaders, error_log
from dlprof_agent.collectors.host import HostCollector
from dlprof_agent.collectors.limits import LimitsCollector
from dlprof_agent.collectors.process import ProcessCollector
from dlprof_agent.collectors.target import Target
from dlprof_agent.exporters.prometheus import NodeCollector, registry_of
from dlprof_agent.probe.protocol import HEADER, encode
from dlprof_agent.probe_link.channel import ChannelTimeouts, ProbeSource
from dlprof_agent.probe_link.client import ProbeClient, ReplyLate
from dlprof_agent.probe_link.exchanges import ProbeExchanges
from dlprof_agent.probe_link.samples import ProbeSample

DRIP_SECONDS = 0.05


def probe_sample(pid: int, steps: int) -> ProbeSample:
    return ProbeSample(pid=pid, step_source="optimizer", steps=(("steady", steps),),
                       samples=(), step_bucket_bounds=(), step_bucket_counts=(0,),
                       step_seconds_sum=0.0, last_step_seconds=None, phase_seconds=(),
                       layers=(), hook_errors=0, dropped_messages=(), settings=())


def finishes(call: Callable[[], object], within: float = 10.0) -> list[object]:
    """``call()``'s result or exception, or [] if it is still running after
    ``within`` seconds (it is left running)."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as error:  # handed to the test
            outcome.append(error)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(within)
    return outcome


@pytest.fixture
def dripping_peer() -> Iterator[tuple[socket.socket, threading.Event]]:
    """A connection whose peer answers any request with a valid header, then its
    payload one byte every DRIP_SECONDS, until told to stop."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    done = threading.Event()
    frame = encode({"ok": True, "probe": {}, "padding": "x" * 10_000})

    def drip() -> None:
        theirs.recv(1 << 16)
        theirs.sendall(frame[:HEADER.size])
        for byte in frame[HEADER.size:]:
            if done.wait(DRIP_SECONDS):
                return
            try:
                theirs.sendall(bytes([byte]))
            except OSError:
                return

    threading.Thread(target=drip, daemon=True).start()
    yield ours, done
    done.set()
    ours.close()
    theirs.close()


def test_a_dripping_reply_ends_at_the_deadline_of_the_whole_exchange(
        dripping_peer: tuple[socket.socket, threading.Event]) -> None:
    connection, _ = dripping_peer
    connection.settimeout(0.3)  # longer than the pause between two bytes
    client = ProbeClient(4242, connection, {"ok": True})
    outcome = finishes(client.snapshot)
    assert outcome, "a reply that drips held the read past any deadline"
    late = outcome[0]
    assert isinstance(late, ReplyLate)
    assert late.received_bytes >= HEADER.size  # it had begun: not a job holding the GIL


class Trickling:
    """A probe client whose replies begin and never end."""

    pid = 4242
    closed = stopped = False
    requests_sent = replies_taken = 0

    def __init__(self) -> None:
        self.hello: dict[str, object] = {}

    def set_timeout(self, seconds: float) -> None:
        pass

    def snapshot(self) -> ProbeSample:
        raise ReplyLate("no whole reply to snapshot yet", received_bytes=120)

    def close(self) -> None:
        self.closed = True

    def stop(self) -> None:
        self.stopped = True


def test_a_reply_that_trickles_pass_after_pass_drops_the_probe_with_a_growing_pause() -> None:
    now = [0.0]
    timeouts = ChannelTimeouts(trickle_limit=3, retry_seconds=(2.0, 4.0, 8.0))
    client = Trickling()
    source = ProbeSource(client, interval=1.0, target=Target(4242, 0), identity=None,  # type: ignore[arg-type]
                         timeouts=timeouts, clock=lambda: now[0])
    assert source.sample() is None and source.condition.state == "stale"
    assert source.sample() is None
    assert source.client is not None, "dropped before the limit"
    assert source.sample() is None
    assert source.client is None and client.closed
    state, reason = source.condition
    assert state == "dropped" and "trickled" in reason
    pauses = []
    for _ in range(2):  # reached again, trickling again: each pause longer
        pauses.append(source._next_try - now[0])
        now[0] = source._next_try
        source._adopt(Trickling())
        for _ in range(3):
            source.sample()
        assert source.client is None
    pauses.append(source._next_try - now[0])
    assert pauses == sorted(pauses) and pauses[0] < pauses[-1], pauses


def test_a_silent_probe_is_late_not_trickling_and_keeps_its_last_sample() -> None:
    now = [0.0]
    answers: list[ProbeSample | ReplyLate] = [probe_sample(4242, 5)]

    class Silent(Trickling):
        def snapshot(self) -> ProbeSample:
            answer = answers[0] if len(answers) == 1 else answers.pop(0)
            if isinstance(answer, ReplyLate):
                raise answer
            return answer

    source = ProbeSource(Silent(), interval=1.0, target=Target(4242, 0), identity=None,  # type: ignore[arg-type]
                         timeouts=ChannelTimeouts(trickle_limit=2), clock=lambda: now[0])
    assert source.sample() is not None and source.condition.state == "ok"
    answers[:] = [ReplyLate("no reply yet"), ReplyLate("no reply yet"),
                  ReplyLate("no reply yet"), ReplyLate("no reply yet")]
    for _ in range(3):
        sample = source.sample()
        assert sample is not None and sample.steady_steps == 5
        assert source.condition.state == "stale" and source.client is not None


class Blocked:
    """A probe read that does not return until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    up = True

    def sample(self) -> ProbeSample | None:
        self.calls += 1
        if self.calls > 1:
            self.release.wait(60)
        return probe_sample(1, self.calls)

    def final_sample(self) -> ProbeSample | None:
        return None

    def stop(self) -> None:
        self.release.set()


class Counting:
    up = True

    def __init__(self, pid: int) -> None:
        self.pid, self.steps = pid, 0

    def sample(self) -> ProbeSample | None:
        self.steps += 1
        return probe_sample(self.pid, self.steps)

    def final_sample(self) -> ProbeSample | None:
        return None


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    started = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
               for _ in range(2)]
    yield started
    for process in started:
        process.kill()
        process.wait()


def test_a_stuck_probe_read_never_delays_another_target(
        sleepers: list[subprocess.Popen[bytes]]) -> None:
    slow_pid, good_pid = (p.pid for p in sleepers)
    stuck, good = Blocked(), Counting(good_pid)
    builder = SnapshotBuilder(host=HostCollector(), gpu=None,
                              errors=error_log(gpu=False, probe=True),
                              probe_deadline_seconds=0.2)
    errors = error_log(gpu=False, probe=False)
    targets = [TargetReaders(pid, ProcessCollector(Target.of(pid), errors=errors),
                             limits=LimitsCollector(Target.of(pid)), probe=probe)
               for pid, probe in ((slow_pid, stuck), (good_pid, good))]
    try:
        builder.build(targets)  # the first read of each answers
        passes = finishes(lambda: [builder.build(targets) for _ in range(3)])
        assert passes, "a stuck probe read held up the pass"
        nodes = passes[0]
        assert isinstance(nodes, list)
        for number, node in enumerate(nodes, start=2):
            slow, fresh = node.targets
            assert fresh.probe is not None and fresh.probe.steady_steps == number
            assert not fresh.probe_stale and fresh.probe_misses == 0
            # The stuck one keeps its last good sample, stale, each miss counted.
            assert slow.probe is not None and slow.probe.steady_steps == 1
            assert slow.probe_stale and slow.probe_misses == number - 1
        assert stuck.calls == 2, "a second read began while the first still ran"
        stuck.release.set()  # its read ends: the next pass takes what it got
        node = builder.build(targets)
        assert not node.targets[0].probe_stale
    finally:
        stuck.release.set()
        builder.close()


def test_a_failing_read_is_counted_and_the_next_pass_reads_again() -> None:
    failures: list[tuple[int, str]] = []
    exchanges = ProbeExchanges(deadline_seconds=5.0,
                               on_error=lambda pid, error: failures.append((pid, str(error))))

    class Failing:
        def sample(self) -> ProbeSample | None:
            raise ConnectionResetError("gone")

    try:
        for _ in range(2):
            (exchange,) = exchanges.read([(7, Failing())])
            assert exchange.sample is None and not exchange.stale
        assert failures == [(7, "gone"), (7, "gone")]
    finally:
        exchanges.close()


def test_the_status_page_lists_stale_and_dropped_probes_with_the_reason(
        sleepers: list[subprocess.Popen[bytes]]) -> None:
    slow_pid, dropped_pid = (p.pid for p in sleepers)
    daemon = Agent(DaemonOptions(probe=None, gpu=False), chooser=OneTarget(Target.of(slow_pid)),
                   host=HostCollector(), gpu=None, errors=error_log(gpu=False, probe=True))
    now = [0.0]
    trickling = ProbeSource(Trickling(), interval=1.0, target=Target(dropped_pid, 0),  # type: ignore[arg-type]
                            identity=None, timeouts=ChannelTimeouts(trickle_limit=1),
                            clock=lambda: now[0])
    errors = error_log(gpu=False, probe=False)
    stuck = Blocked()
    daemon.targets = {
        slow_pid: TargetWatch(Target.of(slow_pid), "match",
                              ProcessCollector(Target.of(slow_pid), errors=errors)),
        dropped_pid: TargetWatch(Target.of(dropped_pid), "match",
                                 ProcessCollector(Target.of(dropped_pid), errors=errors),
                                 probe=trickling)}
    daemon.targets[slow_pid].probe = stuck  # type: ignore[assignment]
    daemon._builder.exchanges.deadline_seconds = 0.2
    try:
        daemon.sample_once()
        node = daemon.sample_once()
        report = daemon.probe_report()
        assert report["stale"] == {str(slow_pid): "no whole reply within the pass's deadline"}
        assert "trickled" in report["dropped"][str(dropped_pid)]
        text = "\n".join(
            f"{sample.name}{sample.labels} {sample.value}"
            for family in registry_of(NodeCollector(lambda: node, interval_seconds=1.0)
                                      ).collect()
            for sample in family.samples if sample.name.startswith("dlprof_probe_"))
        assert f"dlprof_probe_stale{{'pid': '{slow_pid}'}} 1" in text
        assert f"dlprof_probe_deadline_misses_total{{'pid': '{slow_pid}'}} 1" in text
    finally:
        stuck.release.set()
        daemon.close()

