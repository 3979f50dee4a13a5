"""A job that holds the GIL (a long import, a native call that does not release
it) answers the agent late. That must neither hold up the agent's sampling pass
nor count as a lost probe; only a probe that stays silent is dropped."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from dlprof_agent.collectors.target import Target
from dlprof_agent.probe.protocol import HEADER, encode, take_frame
from dlprof_agent.probe_link.channel import ChannelTimeouts, ProbeSource
from dlprof_agent.probe_link.client import ProbeClient, ReplyLate
from dlprof_agent.probe_link.connect import ProbeOptions, connect_probe
from tests.conftest import agent_env

# Once told to go (a line on stdin), steps, then a few seconds in one C call that
# keeps the GIL (libc's usleep through ctypes.PyDLL, which does not release it:
# wall time, whatever the load), then steps again. The hold outlasts the probe's
# lease at 0.1 s (1.3 s). The probe counts steps from the agent's start: a job
# that stepped before it would have marks no agent was there to count.
JOB = textwrap.dedent("""
    import ctypes, sys, time
    from dlprof_agent import probe
    probe.enable()
    libc = ctypes.PyDLL(None)
    print("ready", flush=True)
    sys.stdin.readline()
    def steps(n):
        for _ in range(n):
            time.sleep(0.01)
            probe.step(samples=1)
    steps(50)
    started = time.perf_counter()
    libc.usleep(int(HOLD_SECONDS * 1e6))
    print(f"held {time.perf_counter() - started:.2f}", flush=True)
    steps(50)
    time.sleep(30)
""")


@pytest.fixture
def gil_holding_job() -> Iterator[subprocess.Popen[str]]:
    job = subprocess.Popen([sys.executable, "-c", JOB.replace("HOLD_SECONDS", "2.5")],
                           env=agent_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           text=True)
    assert job.stdout is not None
    assert job.stdout.readline().strip() == "ready"
    yield job
    job.kill()
    job.wait(10)


def go(job: subprocess.Popen[str]) -> None:
    """Let the job start stepping."""
    assert job.stdin is not None
    job.stdin.write("go\n")
    job.stdin.flush()


@pytest.mark.slow  # a real job holding the GIL for seconds
def test_a_job_holding_the_gil_answers_late_and_keeps_its_probe(
        gil_holding_job: subprocess.Popen[str]) -> None:
    client = connect_probe(Target.of(gil_holding_job.pid),
                           ProbeOptions(inject=False, warmup_steps=0),
                           interval=0.1)
    assert client is not None
    go(gil_holding_job)  # its session is up: the probe answered its start
    source = ProbeSource(client, interval=0.1)  # a reply may take 0.25 s
    slowest_pass, repeated = 0.0, 0
    steps_seen: list[int] = []
    deadline = time.monotonic() + 180  # the job's 100 steps, however loaded the host
    while time.monotonic() < deadline:
        started = time.monotonic()
        sample = source.sample()
        slowest_pass = max(slowest_pass, time.monotonic() - started)
        assert source.up, "the probe was dropped"
        if sample is None:  # its first reply is still on its way: nothing to keep yet
            assert not steps_seen, "a late reply lost the last sample"
            time.sleep(0.1)
            continue
        if steps_seen and sample.steady_steps == steps_seen[-1]:
            repeated += 1
        steps_seen.append(sample.steady_steps)
        if sample.steady_steps >= 99:  # 100 step marks bound 99 steps
            break
        time.sleep(0.1)
    source.stop()
    assert gil_holding_job.stdout is not None
    held = float(gil_holding_job.stdout.readline().split()[1])
    assert held > 1.5, f"the job held the GIL for only {held} s: too short to test"
    assert steps_seen[-1] == 99, steps_seen
    assert steps_seen == sorted(steps_seen)  # late replies never go back in time
    assert repeated >= 2  # passes during the hold kept the last sample
    assert slowest_pass < 0.6, f"a sampling pass waited {slowest_pass:.2f} s on the probe"



@pytest.mark.slow  # a real job holding the GIL for seconds
def test_a_probe_silent_past_the_limit_is_dropped(
        monkeypatch: pytest.MonkeyPatch, gil_holding_job: subprocess.Popen[str]) -> None:
    client = connect_probe(Target.of(gil_holding_job.pid), ProbeOptions(inject=False), interval=0.1)
    assert client is not None
    go(gil_holding_job)
    now = [0.0]
    source = ProbeSource(client, interval=0.1, timeouts=ChannelTimeouts(late_limit_seconds=0.3),
                         clock=lambda: now[0])
    assert source.sample() is not None

    def never(self: ProbeClient) -> None:
        raise ReplyLate("no reply to snapshot yet")
    monkeypatch.setattr(ProbeClient, "snapshot", never)
    assert source.sample() is not None  # late: the last sample stands
    now[0] += 0.35
    assert source.sample() is None and not source.up


def test_take_frame_waits_for_a_whole_frame_and_keeps_what_follows() -> None:
    frames = encode({"ok": True, "n": 1}) + encode({"ok": True, "n": 2})
    received = bytearray()
    taken = []
    for byte in frames:  # one byte at a time, as a slow socket might give them
        received.append(byte)
        frame = take_frame(received, max_bytes=1024)
        if frame is not None:
            taken.append(frame["n"])
    assert taken == [1, 2] and not received
    partial = bytearray(encode({"n": 3})[:HEADER.size + 2])
    assert take_frame(partial, max_bytes=1024) is None
    assert len(partial) == HEADER.size + 2  # nothing consumed until it is whole
