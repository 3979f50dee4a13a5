"""No syscall restart code reaches the job. A job's thread waits in read() on a pipe,
on a futex (a lock, with and without a timeout) or in a sleep (``time.sleep``, and
libc's relative ``nanosleep``); the agent injects through its ptrace injector and
through gdb while it waits; the call then returns what it returns undisturbed (the
bytes written, True once the lock is released, a sleep of its full length), never
ERESTARTSYS to ERESTART_RESTARTBLOCK (512-516) or EINTR. A job's main thread is the one
each injector borrows first, and it is the only thread in that wait; a helper thread
waits in read() on a control pipe (it releases the lock), and reports its own result.

Also the rule that keeps a gdb which cannot write this CPU's whole XSAVE area away
(``xstate_refusal``), and what the gdb script does where gdb does not put the thread's
registers back (as gdb 13 on an AMX CPU leaves orig_rax)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import InjectionUnsafe
from dlprof_agent.reach import gdb as gdb_module
from dlprof_agent.reach.gdb_versions import parse_gdb_version, xstate_refusal
from dlprof_agent.reach.inject import inject
from dlprof_agent.reach.xsave_layout import Component, XsaveLayout
from tests.conftest import force_gdb, gdb_refusal
from tests.helpers import wait_until

MACHINE = platform.machine()
GDB = shutil.which("gdb")
# Before 3.14 the agent injects itself (x86-64) or with gdb; from 3.14 with remote_exec
BEFORE_REMOTE_EXEC = not hasattr(sys, "remote_exec")
SLEEP_SECONDS = 4.0  # longer than either injector takes, so it happens inside the sleep
DATA = "forty-two bytes of data, read in one go.\n"

# System call numbers: each wait's, and restart_syscall, which goes on with a relative
# sleep or a timed futex wait after a stop
SYSCALLS: dict[str, dict[str, set[int]]] = {
    "x86_64": {"read": {0}, "lock": {202}, "lock_timeout": {202}, "sleep": {230, 270},
               "nanosleep": {230, 35}, "restart": {219}},
    "aarch64": {"read": {63}, "lock": {98}, "lock_timeout": {98}, "sleep": {115, 72},
                "nanosleep": {115, 101}, "restart": {128}},
}

JOB = r"""
import ctypes, json, os, sys, threading, time
kind, seconds, control, marker = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
libc = ctypes.CDLL(None, use_errno=True)
lock = threading.Lock()
lock.acquire()

def report(**fields):
    os.write(1, (json.dumps(fields) + "\n").encode())

def raw(result):
    return {"result": result, "errno": ctypes.get_errno() if result < 0 else 0}

def helper():
    buffer = ctypes.create_string_buffer(1)
    report(thread="helper", **raw(libc.read(control, buffer, 1)))
    if kind.startswith("lock"):
        lock.release()

class timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

def wait():
    if kind == "read":
        buffer = ctypes.create_string_buffer(64)
        count = libc.read(0, buffer, 64)
        return dict(raw(count), data=buffer.raw[:max(count, 0)].decode())
    if kind == "lock":
        return {"result": lock.acquire()}
    if kind == "lock_timeout":
        return {"result": lock.acquire(timeout=600)}
    if kind == "sleep":
        return {"result": repr(time.sleep(seconds))}
    rest = timespec()
    return raw(libc.nanosleep(ctypes.byref(timespec(int(seconds), 0)), ctypes.byref(rest)))

thread = threading.Thread(target=helper)
thread.start()
print("ready", flush=True)
began = time.monotonic()
try:
    outcome = wait()
except BaseException as error:
    outcome = {"raised": repr(error)}
report(thread="main", began=began, ended=time.monotonic(), **outcome)
thread.join()
deadline = time.monotonic() + 30
while not os.path.exists(marker) and time.monotonic() < deadline:
    time.sleep(0.01)  # Python code runs: the queued call runs here if it has not yet
"""


class Job:
    def __init__(self, kind: str, marker: Path) -> None:
        self.kind = kind
        control, self.control = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-c", JOB, kind, str(SLEEP_SECONDS), str(control), str(marker)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(control,), cwd="/", start_new_session=True)
        os.close(control)
        assert self.process.stdout is not None
        assert self.process.stdout.readline() == b"ready\n"
        self.pid = self.process.pid

    def waits_in(self, numbers: set[int]) -> bool:
        """Its main thread waits in one of the system calls ``numbers``, and its helper
        in read()."""
        tasks = sorted(int(tid) for tid in os.listdir(f"/proc/{self.pid}/task"))
        calls = {tid: _syscall(self.pid, tid) for tid in tasks}
        return (calls.pop(self.pid, None) in numbers
                and list(calls.values()) == [min(SYSCALLS[MACHINE]["read"])])

    def release(self) -> None:
        assert self.process.stdin is not None
        if self.kind == "read":
            self.process.stdin.write(DATA.encode())
            self.process.stdin.flush()
        os.write(self.control, b"x")  # the helper's read ends (and it releases the lock)

    def results(self) -> tuple[dict[str, Any], dict[str, Any], str]:
        """The main thread's report, the helper's, and the job's stderr."""
        out, err = self.process.communicate(timeout=60)
        assert self.process.returncode == 0, (out, err)
        reports = {line["thread"]: line for line in map(json.loads, out.decode().splitlines())}
        return reports["main"], reports["helper"], err.decode()

    def stop(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.process.wait(10)
        for pipe in (self.process.stdin, self.process.stdout, self.process.stderr):
            if pipe is not None:
                pipe.close()
        os.close(self.control)


def _syscall(pid: int, tid: int) -> int | None:
    """The system call thread ``tid`` waits in, while it sleeps in the kernel."""
    try:
        fields = Path(f"/proc/{pid}/task/{tid}/syscall").read_text().split()
        state = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return None
    if state != "S" or not fields or not fields[0].lstrip("-").isdigit():
        return None
    return int(fields[0])


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    started: list[Job] = []
    yield started
    for job in started:
        job.stop()


def _interrupted_wait_returns_its_result(kind: str, jobs: list[Job], tmp_path: Path) -> None:
    """Injects while the job's main thread waits in ``kind``, then ends the wait; every
    call returns its undisturbed result and the injected code runs."""
    if MACHINE not in SYSCALLS:
        pytest.skip(f"no system call numbers for {MACHINE}")
    marker = tmp_path / "ran"
    job = Job(kind, marker)
    jobs.append(job)
    expected = SYSCALLS[MACHINE][kind]
    wait_until(lambda: job.waits_in(expected), 10, what=f"the job to wait in {kind}")
    began = time.monotonic()
    queued = inject(Target.of(job.pid), f"open({str(marker)!r}, 'w').write('ran')")
    injected = time.monotonic()
    assert queued is not None
    # back in its wait (a sleep or a timed wait may go on as restart_syscall)
    wait_until(lambda: job.waits_in(expected | SYSCALLS[MACHINE]["restart"]), 5,
               what=f"the job to wait in {kind} again")
    job.release()
    main, helper, stderr = job.results()
    assert "raised" not in main, main
    assert main["began"] < began and injected < main["ended"], "not injected during the wait"
    if kind == "read":
        assert (main["result"], main["errno"], main["data"]) == (len(DATA), 0, DATA)
    elif kind.startswith("lock"):
        assert main["result"] is True
    else:
        assert main["result"] == (0 if kind == "nanosleep" else "None")
        assert main.get("errno", 0) == 0
        # CLOCK_REALTIME for nanosleep, measured on CLOCK_MONOTONIC: a little slack
        assert main["ended"] - main["began"] >= SLEEP_SECONDS - 0.01
    assert (helper["result"], helper["errno"]) == (1, 0)
    assert stderr == ""  # no "sem_wait: Unknown error 512" from CPython
    assert marker.read_text() == "ran"


KINDS = ["read", *(pytest.param(kind, marks=pytest.mark.slow)
                   for kind in ("lock", "lock_timeout", "sleep", "nanosleep"))]


@pytest.mark.skipif(MACHINE != "x86_64" or not BEFORE_REMOTE_EXEC,
                    reason="the agent's own ptrace injector: x86-64, before Python 3.14")
@pytest.mark.parametrize("kind", KINDS)
def test_the_ptrace_injector_leaves_every_wait_its_result(kind: str, jobs: list[Job],
                                                           tmp_path: Path) -> None:
    _interrupted_wait_returns_its_result(kind, jobs, tmp_path)


def _gdb_refused_here() -> str | None:
    if not BEFORE_REMOTE_EXEC:
        return "from Python 3.14 the agent injects with sys.remote_exec, not gdb"
    return gdb_refusal()


def _gdb_calling(monkeypatch: pytest.MonkeyPatch) -> None:
    """gdb's turn, for a test in which gdb calls into the job and must put its thread
    back whole: skipped where it cannot (AMX before gdb 14.1)."""
    refused = _gdb_refused_here()
    if refused is not None:
        pytest.skip(refused)
    force_gdb(monkeypatch)


@pytest.mark.parametrize("kind", KINDS)
def test_gdb_leaves_every_wait_its_result(kind: str, jobs: list[Job], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _gdb_calling(monkeypatch)
    _interrupted_wait_returns_its_result(kind, jobs, tmp_path)


def _script_with(monkeypatch: pytest.MonkeyPatch, anchor: str, replacement: str) -> None:
    assert anchor in gdb_module._GDB_PYTHON
    monkeypatch.setattr(gdb_module, "_GDB_PYTHON",
                        gdb_module._GDB_PYTHON.replace(anchor, replacement, 1))


# After gdb's calls, orig_rax as gdb 13 leaves it on an AMX CPU: -1, from its write of
# the PC for the call, where putting the registers back stopped at the first vector one
_CALLS = "        _call(payload)\n"
_LOSE_ORIG_RAX = _CALLS + "        gdb.execute('set $orig_rax = -1', to_string=True)\n"


@pytest.mark.slow
@pytest.mark.skipif(MACHINE != "x86_64", reason="orig_rax is x86-64's")
def test_registers_gdb_did_not_put_back_go_back(jobs: list[Job], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    _gdb_calling(monkeypatch)
    _script_with(monkeypatch, _CALLS, _LOSE_ORIG_RAX)
    with caplog.at_level(logging.WARNING, logger="dlprof_agent"):
        _interrupted_wait_returns_its_result("read", jobs, tmp_path)
    assert "gdb did not put back registers orig_rax" in caplog.text


@pytest.mark.slow
@pytest.mark.skipif(MACHINE != "x86_64", reason="orig_rax is x86-64's")
def test_without_putting_them_back_the_restart_code_reaches_the_job(
        jobs: list[Job], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the check above prevents, as it failed on Sapphire Rapids: the kernel
    restarts nothing, and read() returns -1 with errno 512 (ERESTARTSYS)."""
    _gdb_calling(monkeypatch)
    _script_with(monkeypatch, _CALLS, _LOSE_ORIG_RAX)
    _script_with(monkeypatch, "_put_back(saved) if saved", "([], []) if saved")
    marker = tmp_path / "ran"
    job = Job("read", marker)
    jobs.append(job)
    wait_until(lambda: job.waits_in(SYSCALLS[MACHINE]["read"]), 10, what="the job's read")
    inject(Target.of(job.pid), f"open({str(marker)!r}, 'w').write('ran')")
    job.release()
    main, _, _ = job.results()
    assert (main["result"], main["errno"]) == (-1, 512)


@pytest.mark.slow
@pytest.mark.skipif(MACHINE != "x86_64", reason="the XSAVE area is x86-64's")
def test_a_gdb_that_cannot_write_the_xsave_area_calls_nothing(
        jobs: list[Job], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its write of a vector register fails (as gdb 13's does on an AMX CPU): refused
    before any call, in one line, and the job's wait is as it was. Nothing is called, so
    this runs wherever gdb does, with the agent's own refusal (AMX) set aside."""
    force_gdb(monkeypatch)
    _script_with(monkeypatch, '"set $xmm15.v2_int64[0] = %d" % (word ^ 1)',
                 '"set $xmm15.no_such_lane = 1"')
    marker = tmp_path / "ran"
    job = Job("read", marker)
    jobs.append(job)
    wait_until(lambda: job.waits_in(SYSCALLS[MACHINE]["read"]), 10, what="the job's read")
    with pytest.raises(InjectionUnsafe) as raised:
        inject(Target.of(job.pid), f"open({str(marker)!r}, 'w').write('ran')")
    line = raised.value.one_line()
    assert "cannot write the extended registers (XSAVE) of this CPU" in line, line
    assert "\n" not in line and "install gdb 14.1 or newer" in line
    assert not marker.exists()
    marker.touch()  # nothing was queued: the job need not wait for it
    job.release()
    main, _, _ = job.results()
    assert (main["result"], main["errno"], main["data"]) == (len(DATA), 0, DATA)


# --- the rule ------------------------------------------------------------------------

# Sapphire Rapids: AVX, AVX-512, PKRU, AMX (XFD-guarded TILEDATA), as CPUID gives them
AMX = XsaveLayout(0x602E7, {2: Component(576, 256, False), 5: Component(1088, 64, False),
                            6: Component(1152, 512, False), 7: Component(1664, 1024, False),
                            9: Component(2688, 8, False), 17: Component(2752, 64, False),
                            18: Component(2816, 8192, True)})
AVX512 = XsaveLayout(0xE7, {index: AMX.components[index] for index in (2, 5, 6, 7)})
AVX = XsaveLayout(0x7, {2: AMX.components[2]})


@pytest.mark.parametrize(("text", "version"), [
    ("GNU gdb (Debian 13.1-3) 13.1\nCopyright (C) 2023", (13, 1)),
    ("GNU gdb (GDB) 14.2", (14, 2)),
    ("GNU gdb (Ubuntu 15.0.50.20240403-0ubuntu1) 15.0.50.20240403-git", (15, 0)),
    ("GNU gdb (GDB) Red Hat Enterprise Linux 10.2-13.el9", (10, 2)),
    ("GNU gdb (GDB) Fedora Linux 16.3-1.fc42", (16, 3)),
    ("not a gdb", None),
    ("", None),
])
def test_the_gdb_version_is_read_from_its_first_line(text: str,
                                                     version: tuple[int, int] | None) -> None:
    assert parse_gdb_version(text) == version


def test_a_gdb_that_cannot_write_the_whole_xsave_area_is_refused() -> None:
    assert AMX.size(AMX.xcr0) == 11008
    why = xstate_refusal((13, 1), AMX)
    assert why == ("gdb 13.1 cannot restore the AMX TILECFG, AMX TILEDATA registers of "
                   "this CPU (XSAVE area 11008 bytes, gdb writes 2696)")
    error = InjectionUnsafe(f"not injecting into process 1 with gdb: {why}", "hint")
    assert "\n" not in error.one_line()
    assert "gdb 7.12 cannot restore the AVX-512" in (xstate_refusal((7, 12), AVX512) or "")


@pytest.mark.parametrize(("version", "layout"), [
    ((14, 1), AMX), ((16, 3), AMX),  # sized from CPUID
    ((13, 1), AVX512), ((8, 0), AVX512), ((7, 6), AVX),  # fits the fixed buffer
    (None, AMX), ((13, 1), None),  # unknown: the script checks before its calls
])
def test_a_gdb_that_can_is_not(version: tuple[int, int] | None,
                               layout: XsaveLayout | None) -> None:
    assert xstate_refusal(version, layout) is None
