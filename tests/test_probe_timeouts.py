"""The probe channel's timeouts and the probe's lease are parameters with the
production values as defaults, so that a test can shorten them instead of
waiting them out. Each runs here against a real probe in a child process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from dlprof_agent.collectors import procfs
from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import ConnectionClosed, ProbeAlreadyAttached
from dlprof_agent.probe.session import DEFAULT_OPTIONS, Session, checked_options
from dlprof_agent.probe_link.channel import (
    DEFAULT_TIMEOUTS,
    LATE_LIMIT_SECONDS,
    ChannelTimeouts,
    ProbeSource,
)
from dlprof_agent.probe_link.client import ProbeClient
from dlprof_agent.probe_link.connect import ProbeOptions, try_connect
from tests.conftest import agent_env, wait_for

JOB = textwrap.dedent("""
    import time
    from dlprof_agent import probe
    probe.enable()
    print("ready", flush=True)
    time.sleep(120)
""")


@pytest.fixture
def probe_job() -> Iterator[subprocess.Popen[str]]:
    job = subprocess.Popen([sys.executable, "-c", JOB], env=agent_env(),
                           stdout=subprocess.PIPE, text=True)
    assert job.stdout is not None
    assert job.stdout.readline().strip() == "ready"
    yield job
    os.kill(job.pid, signal.SIGCONT)
    job.kill()
    job.wait(10)


def test_the_defaults_are_the_production_values() -> None:
    assert DEFAULT_TIMEOUTS.late_limit_seconds == LATE_LIMIT_SECONDS
    # A reply waits half an interval on the pass, within a quarter second and 2 s.
    assert [DEFAULT_TIMEOUTS.reply_wait(i) for i in (0.1, 1.0, 10.0)] == [0.25, 0.5, 2.0]
    assert ChannelTimeouts(reply_wait_bounds_seconds=(0.01, 0.05)).reply_wait(1.0) == 0.05
    assert ProbeOptions().lease_seconds is None  # the probe's own rule


def test_the_lease_an_agent_asks_for_replaces_the_probes_rule() -> None:
    left, right = socket.socketpair()
    with left, right:
        slow = checked_options({"interval_seconds": 60.0}, DEFAULT_OPTIONS)
        assert Session(left, 1, 0, slow).lease_seconds == 181.0  # 3 intervals + 1 s
        short = checked_options({"interval_seconds": 60.0, "lease_seconds": 0.5},
                                DEFAULT_OPTIONS)
        session = Session(left, 1, 0, short)
        assert session.lease_seconds == 0.5
        assert session.options()["lease_seconds"] == 0.5  # configure starts from it
    for bad in (-1.0, 1e9, "1"):
        with pytest.raises(ValueError, match="lease_seconds"):
            checked_options({"lease_seconds": bad}, DEFAULT_OPTIONS)


def test_a_silent_agent_loses_its_session_after_the_lease_it_asked_for(
        probe_job: subprocess.Popen[str]) -> None:
    # At a 60 s interval the probe's own lease is 181 s; asked for 0.3 s, it ends
    # the silent agent's session and lets the next one in well within the deadline.
    silent = try_connect(Target.of(probe_job.pid), ProbeOptions(inject=False, lease_seconds=0.3),
                         60.0, 0.0)

    def next_agent() -> ProbeClient | None:
        try:
            return try_connect(Target.of(probe_job.pid), ProbeOptions(inject=False), 1.0, 0.0)
        except ProbeAlreadyAttached:
            return None

    successor: ProbeClient = wait_for(next_agent, "the probe to end the silent session", 20)
    try:
        # The probe closed the silent agent's connection as it ended its session...
        with pytest.raises((ConnectionClosed, OSError)):
            silent.request("snapshot")
        # ...and serves the next one: a snapshot raises unless its reply is ok.
        assert successor.snapshot().hook_errors == 0
    finally:
        successor.stop()
        silent.close()


def all_threads_stopped(pid: int) -> bool:
    stats = [procfs.read_stat(pid, tid=tid) for tid in procfs.list_tasks(pid)]
    return all(stat is not None and stat.state == "T" for stat in stats)


def test_a_stopped_job_is_kept_then_dropped_on_the_channels_own_limits(
        probe_job: subprocess.Popen[str]) -> None:
    client = try_connect(Target.of(probe_job.pid), ProbeOptions(inject=False), 0.1, 0.0)
    now = [1000.0]
    source = ProbeSource(client, interval=0.1, clock=lambda: now[0],
                         timeouts=ChannelTimeouts(late_limit_seconds=5.0,
                                                  silent_limit_seconds=60.0,
                                                  reply_wait_bounds_seconds=(0.05, 0.05)))
    first = source.sample()
    assert first is not None and source.up
    os.kill(probe_job.pid, signal.SIGSTOP)  # it cannot answer now
    # Once every thread has stopped: a thread woken by the stop but not yet run
    # could still read a request sent meanwhile and answer it.
    wait_for(lambda: all_threads_stopped(probe_job.pid), "the job to stop", 10)
    assert source.sample() is first  # late: the last sample stands
    now[0] += 5.0
    assert source.sample() is None and not source.up  # past the late limit: down
    assert source.client is client  # its reply is still awaited
    now[0] += 55.0
    assert source.sample() is None and source.client is None  # past the silent limit
    source.stop()


# A job whose probe, once injected, binds its socket a second before it listens, as
# when the job's other threads hold the GIL between the two calls.
LATE_LISTENER = textwrap.dedent("""
    import _socket, socket, threading, time
    def listen_late(self, *args):
        time.sleep(1.0)
        return _socket.socket.listen(self, *args)
    socket.socket.listen = listen_late
    print("ready", flush=True)
    threading.Event().wait(120)
""")


def test_an_injected_probe_that_listens_late_is_reached_by_the_first_injection() -> None:
    job = subprocess.Popen([sys.executable, "-c", LATE_LISTENER], env=agent_env(),
                           stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == "ready"
        client = try_connect(Target.of(job.pid), ProbeOptions(), 1.0, 0.0)
        try:
            assert client.hello["pid"] == job.pid
        finally:
            client.stop()
            client.close()
    finally:
        job.kill()
        job.wait(10)
