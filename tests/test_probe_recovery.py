"""The probe is never lost for good: not to a frame built to crash its decoder,
nor to a client that sends one byte at a time, nor to a job that holds the GIL
or is stopped, nor to an agent that is stopped; after exec the agent says that
the pid runs another program. Real jobs, real agents, real sockets."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlprof_agent.probe import session
from tests import short_waits
from tests.conftest import REPO, agent_env, free_port, http_get, wait_for
from tests.helpers import wait_until

pytestmark = pytest.mark.e2e

# Steps every 10 ms, with the probe enabled (as `run` or the job's own code does),
# unless --inject-me: then the agent injects it. Between steps it looks in its
# control folder: "hold" holds the GIL in one C call for that many seconds (libc's
# sleep through ctypes.PyDLL, which keeps the GIL: wall time, whatever the load),
# "exec" execs the Python code in it. --short-lease: its probe takes a silent
# agent for gone after SHORT_LEASE_SECONDS (three intervals and a margin at 0.2 s),
# not the 2 s minimum.
SHORT_LEASE_SECONDS = 1.6
JOB = textwrap.dedent("""
    import ctypes, os, sys, time
    control = sys.argv[1]
    if "--short-lease" in sys.argv:
        from dlprof_agent.probe import session
        session.MIN_LEASE_SECONDS = SHORT_LEASE_SECONDS
    if "--inject-me" not in sys.argv:
        from dlprof_agent import probe
        probe.enable()
    libc = ctypes.PyDLL(None)
    print("ready", flush=True)
    while True:
        time.sleep(0.01)
        module = sys.modules.get("dlprof_agent.probe")  # injected: once it is loaded
        if module is not None and not getattr(module.__spec__, "_initializing", False):
            module.step(samples=1)
        hold = os.path.join(control, "hold")
        if os.path.exists(hold):
            seconds = float(open(hold).read())
            os.unlink(hold)
            print("holding", flush=True)
            started = time.perf_counter()
            libc.usleep(int(seconds * 1e6)) if seconds < 1 else libc.sleep(int(seconds))
            print(f"held {time.perf_counter() - started:.1f}", flush=True)
        program = os.path.join(control, "exec")
        if os.path.exists(program):
            code = open(program).read()
            os.unlink(program)
            os.execv(sys.executable, [sys.executable, "-c", code])
""").replace("SHORT_LEASE_SECONDS", repr(SHORT_LEASE_SECONDS))


LOGS: dict[int, Path] = {}  # an agent's pid: the file its stderr goes to


class Job:
    def __init__(self, process: subprocess.Popen[str], control: Path) -> None:
        self.process = process
        self.pid = process.pid
        self.control = control

    def hold(self, seconds: float) -> float:
        """Hold the GIL for about ``seconds``; returns once it has begun."""
        (self.control / "hold").write_text(str(seconds))
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "holding"
        return time.monotonic()

    def held(self) -> float:
        assert self.process.stdout is not None
        return float(self.process.stdout.readline().split()[1])


@pytest.fixture(autouse=True)
def remove_agent_logs() -> Iterator[None]:
    """After the test (and the ``processes`` it started are killed), the agents' logs go."""
    yield
    while LOGS:
        LOGS.popitem()[1].unlink(missing_ok=True)


def start_job(processes: list[subprocess.Popen[str]], tmp_path: Path, *args: str) -> Job:
    control = tmp_path / f"control-{len(processes)}"
    control.mkdir()
    process = subprocess.Popen([sys.executable, "-c", JOB, str(control), *args], cwd=REPO,
                               env=agent_env(), stdout=subprocess.PIPE, text=True)
    processes.append(process)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    return Job(process, control)


def attach(processes: list[subprocess.Popen[str]], pid: int, *args: str,
           short_waits: bool = False) -> tuple[subprocess.Popen[str], int]:
    """An agent attached to ``pid``; ``short_waits``: with the channel's late limit
    and pause before reaching a lost probe shortened (``tests/short_waits.py``)."""
    port = free_port()
    command = ["-m", "tests.short_waits"] if short_waits else ["-m", "dlprof_agent"]
    log = Path(tempfile.mkstemp(prefix="dlprof-agent-", suffix=".log")[1])
    with log.open("w") as stderr:
        agent = subprocess.Popen(
            [sys.executable, *command, "attach", str(pid), "--port", str(port),
             "--interval", "0.2", "--quiet", "--warmup-steps", "0", *args],
            cwd=REPO, env=agent_env(), stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    LOGS[agent.pid] = log
    processes.append(agent)
    wait_for(lambda: b"dlprof_target_up" in http_get(f"http://127.0.0.1:{port}/metrics"),
             "the agent's first sample", 60)
    return agent, port


def value(port: int, name: str) -> float | None:
    for line in http_get(f"http://127.0.0.1:{port}/metrics").decode().splitlines():
        if line.startswith((name + "{", name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return None


def probe_up(port: int) -> bool:
    return value(port, "dlprof_probe_up") == 1


def steps(port: int) -> float:
    return value(port, 'dlprof_steps_total') or 0.0


def dropped(port: int, reason: str) -> float:
    text = http_get(f"http://127.0.0.1:{port}/metrics").decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dlprof_probe_dropped_messages_total{")
               and f'reason="{reason}"' in line)


def said(agent: subprocess.Popen[str]) -> str:
    """What the agent has logged so far."""
    return LOGS[agent.pid].read_text()


def stderr_of(agent: subprocess.Popen[str]) -> str:
    agent.terminate()
    agent.wait(30)
    log = LOGS.pop(agent.pid)
    text = log.read_text()
    log.unlink()
    return text


def sockets(pid: int) -> int:
    """How many sockets ``pid`` has open: its probe's listening one and a connection
    per agent in session."""
    fds = Path(f"/proc/{pid}/fd")
    return sum(1 for fd in fds.iterdir() if os.readlink(fd).startswith("socket:"))


def probe_path(pid: int) -> str:
    return f"/tmp/dlprof-agent-{os.geteuid()}/probe-{pid}.sock"


def frame(payload: bytes) -> bytes:
    from dlprof_agent.probe.protocol import HEADER, MAGIC, VERSION
    return HEADER.pack(MAGIC, VERSION, len(payload)) + payload


START = b'{"command":"start","args":{"interval_seconds":1.0}}'
DEEP = b'{"command":' + b"[" * 30_000 + b"]" * 30_000 + b"}"  # 60 kB: within the limit


def test_a_deeply_nested_frame_leaves_the_probe_serving(
        processes: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    job = start_job(processes, tmp_path)
    for opening in ([], [START]):  # as the first frame, and inside a session
        with socket.socket(socket.AF_UNIX) as client:
            client.settimeout(10)
            client.connect(probe_path(job.pid))
            for data in opening:
                client.sendall(frame(data))
                assert b'"ok":true' in client.recv(4096)
            client.sendall(frame(DEEP))
            with contextlib.suppress(ConnectionResetError):  # or recv ends: it hung up
                while client.recv(4096):
                    pass
    agent, port = attach(processes, job.pid, "--no-inject")
    wait_for(lambda: steps(port) >= 20, "steps from the probe after the deep frames", 30)
    assert dropped(port, "oversized") + dropped(port, "malformed") == 2
    assert job.process.poll() is None
    stderr_of(agent)


def dribble(path: str, data: bytes, every: float, stop: threading.Event,
            closed_after: list[float]) -> None:
    """Send ``data`` a byte at a time; note when the probe closed the connection."""
    started = time.monotonic()
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(path)
        for byte in data:
            if stop.wait(every):
                return
            try:
                client.sendall(bytes([byte]))
            except OSError:
                closed_after.append(time.monotonic() - started)
                return
        closed_after.append(-1.0)


def test_a_client_sending_one_byte_at_a_time_denies_no_agent(
        processes: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    job = start_job(processes, tmp_path)
    stop = threading.Event()
    closed_after: list[float] = []
    slow = threading.Thread(target=dribble, args=(probe_path(job.pid), frame(START), 0.5, stop,
                                                  closed_after), daemon=True)
    slow.start()
    try:
        time.sleep(1.0)  # it has begun its frame
        agent, port = attach(processes, job.pid, "--no-inject")
        wait_for(lambda: probe_up(port), "the agent to reach the probe beside the slow client",
                 15)
        assert slow.is_alive()  # still dribbling
        slow.join(15)
        assert closed_after and 0 < closed_after[0] < 10, closed_after  # its frame's deadline
        wait_for(lambda: dropped(port, "timeout") == 1, "the slow client to be counted", 10)
        assert "did not answer" not in stderr_of(agent)
    finally:
        stop.set()


def test_the_agent_waits_through_a_stopped_job_and_says_when_the_probe_is_back(
        processes: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    job = start_job(processes, tmp_path)
    agent, port = attach(processes, job.pid, "--no-inject", short_waits=True)
    wait_for(lambda: steps(port) >= 10, "steps before the stop", 30)
    os.kill(job.pid, signal.SIGSTOP)
    try:  # the late limit (3 s here) outlasts the probe's lease (2 s)
        wait_until(lambda: not probe_up(port), 30,
                   what="the probe to count as down past the agent's late limit")
    finally:
        os.kill(job.pid, signal.SIGCONT)
    before = steps(port)
    wait_for(lambda: probe_up(port) and steps(port) > before + 10, "the probe back", 30)
    stderr = stderr_of(agent)
    assert stderr.count("waiting for the probe in pid") == 1, stderr
    assert f"probe back in pid {job.pid}" in stderr


def test_a_stopped_agent_reaches_the_probe_again(
        processes: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    """The probe took the silent agent for gone (rightly): the agent, resumed,
    connects again instead of giving up."""
    job = start_job(processes, tmp_path, "--short-lease")
    agent, port = attach(processes, job.pid, "--no-inject", short_waits=True)
    wait_for(lambda: steps(port) >= 10, "steps before the stop", 30)
    connected = sockets(job.pid)
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: sockets(job.pid) < connected, 30,
                   what="the probe to close the silent agent's connection past its lease")
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    wait_for(lambda: f"probe back in pid {job.pid}" in said(agent), "the probe back", 40)
    wait_for(lambda: probe_up(port) and steps(port) >= 10, "steps again", 30)
    stderr_of(agent)


def test_attaching_during_a_long_hold_of_the_gil_gets_the_probe_once_it_ends(
        processes: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    job = start_job(processes, tmp_path)
    job.hold(8)
    agent, port = attach(processes, job.pid, "--no-inject")
    assert job.held() > 5, "the hold was too short to test"
    wait_for(lambda: probe_up(port) and steps(port) >= 10, "the probe after the hold", 60)
    stderr = stderr_of(agent)
    assert "the probe in it did not answer" in stderr, stderr
    assert "injected" not in stderr  # nothing was
    assert f"probe back in pid {job.pid}" in stderr


@pytest.mark.skipif(shutil.which("gdb") is None, reason="injection needs gdb")
def test_an_injected_probe_survives_a_hold_longer_than_the_agents_late_limit(
        processes: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    job = start_job(processes, tmp_path, "--inject-me")
    agent, port = attach(processes, job.pid, short_waits=True)
    wait_for(lambda: steps(port) >= 10, "steps from the injected probe", 60)
    job.hold(short_waits.LATE_LIMIT_SECONDS + 4)
    wait_for(lambda: not probe_up(port), "the probe to count as down during the hold", 20)
    assert job.held() > short_waits.LATE_LIMIT_SECONDS + 1, "the hold was too short to test"
    before = steps(port)
    wait_for(lambda: probe_up(port) and steps(port) > before + 10, "the probe back", 30)
    assert os.path.exists(probe_path(job.pid))  # it did not take the hold for a departure
    stderr = stderr_of(agent)
    assert "waiting for the probe" in stderr and f"probe back in pid {job.pid}" in stderr


@pytest.mark.skipif(shutil.which("gdb") is None, reason="injection needs gdb")
def test_an_injection_that_finds_no_safe_point_is_tried_again_later(
        processes: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    """A hold longer than the injector's wait (10 s) at attach: the first
    injection gives up, a later pass injects once the job runs Python again."""
    job = start_job(processes, tmp_path, "--inject-me")
    job.hold(16)
    agent, port = attach(processes, job.pid)
    assert job.held() > 11, "the hold was too short to test"
    wait_for(lambda: probe_up(port) and steps(port) >= 10, "the probe, injected later", 90)
    stderr = stderr_of(agent)
    assert "trying again on later passes" in stderr, stderr
    assert f"probe back in pid {job.pid}" in stderr


def test_after_exec_the_agent_says_the_pid_runs_another_program_and_reaches_its_probe(
        processes: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    job = start_job(processes, tmp_path)
    agent, port = attach(processes, job.pid, "--no-inject")
    wait_for(lambda: steps(port) >= 10, "steps before exec", 30)
    (job.control / "exec").write_text(
        "import time\nfrom dlprof_agent import probe\nprobe.enable()\n"
        "while True:\n    time.sleep(0.01)\n    probe.step(samples=1)\n")
    # What the agent said, not a probe_up of 0: that lasts a pass or two, which a
    # slow poll can miss.
    exec_said = f"process {job.pid} now runs another program (exec)"
    wait_for(lambda: exec_said in said(agent), "the agent to say the pid exec'd", 20)
    wait_for(lambda: probe_up(port), "the new program's probe", 40)
    stderr = stderr_of(agent)
    assert "import time" in stderr  # the new command line is named
    back = f"probe back in pid {job.pid}"
    assert back in stderr.split(exec_said, 1)[1], stderr  # the old probe was let go


def test_a_job_ended_by_sigterm_leaves_no_socket_behind_the_next_probe(
        processes: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    first = start_job(processes, tmp_path)
    stale = probe_path(first.pid)
    assert os.path.exists(stale)
    first.process.terminate()  # SIGTERM: no atexit, the socket stays
    first.process.wait(10)
    assert os.path.exists(stale)
    start_job(processes, tmp_path)  # its probe clears what dead processes left
    assert not os.path.exists(stale)


def test_garbage_beside_an_attached_agent_is_counted_and_learns_nothing(
        processes: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    job = start_job(processes, tmp_path)
    agent, port = attach(processes, job.pid, "--no-inject")
    wait_for(lambda: probe_up(port), "the agent", 30)
    replies = []
    for garbage in [os.urandom(64) for _ in range(5)] + [
            frame(b'{"command":"exec"}'), frame(b"[1]"), frame(b"{"),
            frame(b'{"command":' + b"[" * 100 + b"]" * 100 + b"}"),
            frame(b'{"command":"snapshot"}')]:
        with socket.socket(socket.AF_UNIX) as client:
            client.settimeout(10)
            client.connect(probe_path(job.pid))
            reply = b""
            try:
                client.sendall(garbage)
                client.shutdown(socket.SHUT_WR)
                while chunk := client.recv(4096):
                    reply += chunk
            except (ConnectionResetError, BrokenPipeError):
                pass
            replies.append(reply)
    wait_for(lambda: sum(dropped(port, reason) for reason in
                         ("malformed", "oversized", "version", "unknown", "timeout")) == 10,
             "all ten to be counted", 15)
    assert not any(str(agent.pid).encode() in reply for reply in replies), replies
    assert not any(b"agent_pid" in reply for reply in replies), replies
    stderr_of(agent)


def test_a_probe_kept_from_running_does_not_take_it_for_the_agents_departure(
        processes: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    """Job and agent stopped together (a frozen cgroup, a suspended VM), the job
    resumed first: the probe finds the agent's lease long expired, and nothing
    sent. It could not run either; the session goes on, nothing is reconnected."""
    job = start_job(processes, tmp_path)  # the whole lease: a loaded machine must not end it
    agent, port = attach(processes, job.pid, "--no-inject")
    wait_for(lambda: steps(port) >= 10, "steps before the freeze", 30)
    os.kill(agent.pid, signal.SIGSTOP)
    os.kill(job.pid, signal.SIGSTOP)
    time.sleep(session.MIN_LEASE_SECONDS + 1)  # both stopped past the probe's lease
    os.kill(job.pid, signal.SIGCONT)
    time.sleep(0.3)  # the probe's thread wakes first
    os.kill(agent.pid, signal.SIGCONT)
    before = steps(port)
    wait_for(lambda: steps(port) > before + 10, "steps after the freeze", 30)
    stderr = stderr_of(agent)
    assert "lost the probe" not in stderr and "probe back" not in stderr, stderr
