"""A gdb the agent had to kill does not leave the job stopped. PTRACE_ATTACH sends the
job SIGSTOP, which gdb consumes in its wait; a gdb killed between the two leaves it
pending, and once the kernel detaches the dead tracer it stops the whole job
(ptrace(2): tracees are restarted "unless they were in group-stop"). A stand-in for
gdb attaches exactly so, never waits, and ignores SIGINT, so the agent's session
ends in SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from dlprof_agent.collectors.procfs import read_state
from dlprof_agent.collectors.target import Target
from dlprof_agent.reach import gdb
from tests.helpers import wait_until

# Attaches to argv[1] with PTRACE_ATTACH and holds it without ever calling waitpid
STUCK_TRACER = r"""
import ctypes, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_ATTACH = 16
if libc.ptrace(PTRACE_ATTACH, int(sys.argv[1]), None, None) != 0:
    sys.exit(f"attach failed: errno {ctypes.get_errno()}")
print("attached", flush=True)
time.sleep(600)
"""
JOB = "import time\nwhile True: time.sleep(0.01)\n"


@pytest.fixture
def job() -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen([sys.executable, "-c", JOB])
    yield process
    process.kill()
    process.wait(10)


def test_a_killed_gdb_leaves_the_job_running(job: subprocess.Popen[bytes],
                                              monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(gdb, "GDB_SESSION_SECONDS", 1.0)
    monkeypatch.setattr(gdb, "_UNWIND_SECONDS", 0.5)
    output = gdb._run_gdb(Target.of(job.pid), [sys.executable, "-c", STUCK_TRACER, str(job.pid)])
    assert output.strip() == "attached", output
    assert "gdb was killed while attached and left the job stopped" in caplog.text
    # Running again: in a sleep (S) or on a CPU (R), not stopped (T)
    wait_until(lambda: read_state(job.pid) in ("S", "R"), 5, what="the job to run again")


def test_a_job_the_user_stopped_is_not_continued_by_the_agent(
        job: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    job.send_signal(signal.SIGSTOP)
    wait_until(lambda: read_state(job.pid) == "T", 5, what="the job to stop")
    monkeypatch.setattr(gdb, "GDB_SESSION_SECONDS", 1.0)
    monkeypatch.setattr(gdb, "_UNWIND_SECONDS", 0.5)
    gdb._run_gdb(Target.of(job.pid), [sys.executable, "-c", STUCK_TRACER, str(job.pid)])
    # The user's stop is the user's: no SIGCONT from the agent (what the kernel does
    # when the tracer dies is the kernel's)
    assert "left the job stopped" not in caplog.text
    job.send_signal(signal.SIGCONT)
