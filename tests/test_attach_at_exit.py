"""A job attached while it exits is left to exit as it would have. After
``Py_FinalizeEx`` a job runs its C++ and libc exit handlers (libtorch's destructors
take seconds); a thread borrowed then to call ``Py_AddPendingCall`` found no
interpreter and the job died with SIGSEGV (at address 0x70, NULL's field) instead of
exiting 0, as Hugging Face and Lightning jobs attached near their end did. Here the
job's last exit handler waits in read() for a line, the agent injects from its own
process, and the job must then exit 0 with nothing on stderr."""

from __future__ import annotations

import ctypes
import json
import platform
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlprof_agent.reach.shutdown import LifeWords, life_words, shutting_down
from tests.helpers import NO_OWN_INJECTOR, OWN_INJECTOR, wait_until
from tests.test_syscall_restart import BEFORE_REMOTE_EXEC, SYSCALLS

MACHINE = platform.machine()
REPO = Path(__file__).resolve().parents[1]

# libc's exit() runs this handler after Py_FinalizeEx: it waits in read(0) for a line.
# (atexit itself is not exported by glibc; __cxa_atexit is what it calls.)
JOB = r"""
import ctypes, sys
libc = ctypes.CDLL(None)
libc.__cxa_atexit(ctypes.cast(libc.getchar, ctypes.c_void_p), None, None)
print("ready", flush=True)
sys.stdin.readline()
print("finalizing", flush=True)
"""

# The agent's side, in its own process as in `dlprof-agent attach`: the job's exit
# status is then the job's own, not reaped by the test as its tracer.
AGENT = r"""
import json, sys
from dlprof_agent.collectors.target import Target
from dlprof_agent.reach import gdb, inject as injector
if sys.argv[2] == "gdb":  # gdb's turn, even on AMX: at exit it must call nothing
    injector.plan_calls = lambda target, runtime: None
    gdb._refuse_unsafe_gdb = lambda target, path: None
try:
    queued = injector.inject(Target.of(int(sys.argv[1])), "print('probe ran')", wait_seconds=5.0)
    said = {"queued": repr(queued)}
except Exception as error:
    said = {"raised": type(error).__name__, "message": str(error)}
print(json.dumps(said))
"""


@pytest.fixture
def exiting_job() -> Iterator[subprocess.Popen[bytes]]:
    job = subprocess.Popen([sys.executable, "-c", JOB], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/")
    try:
        assert job.stdout is not None and job.stdout.readline() == b"ready\n"
        yield job
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(10)


def _main_thread_call(pid: int) -> int | None:
    try:
        fields = Path(f"/proc/{pid}/syscall").read_text().split()
    except OSError:
        return None
    return int(fields[0]) if fields and fields[0].isdigit() else None


def _check_exit_is_untouched(job: subprocess.Popen[bytes], injector: str) -> None:
    assert job.stdin is not None and job.stdout is not None
    job.stdin.write(b"exit\n")
    job.stdin.flush()
    assert job.stdout.readline() == b"finalizing\n"
    # Past "finalizing" the only read left is the exit handler's
    wait_until(lambda: _main_thread_call(job.pid) in SYSCALLS[MACHINE]["read"], 10,
               what="the job's exit handler to wait in read()")
    agent = subprocess.run([sys.executable, "-c", AGENT, str(job.pid), injector],
                           capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    said = json.loads(agent.stdout.splitlines()[-1])
    out, err = job.communicate(b"\n", timeout=30)  # its exit handler's line
    assert (job.returncode, err) == (0, b""), said  # not -11 (SIGSEGV)
    assert out == b""  # the probe's code never ran
    assert said.get("raised") == "InjectionNotNow", said
    assert "shutting its Python interpreter down" in said["message"]


@pytest.mark.skipif(not OWN_INJECTOR, reason=NO_OWN_INJECTOR)
def test_the_ptrace_injector_leaves_an_exiting_job_to_exit_0(
        exiting_job: subprocess.Popen[bytes]) -> None:
    _check_exit_is_untouched(exiting_job, "ptrace")


@pytest.mark.slow
@pytest.mark.skipif(MACHINE not in SYSCALLS, reason=f"no system call numbers for {MACHINE}")
def test_gdb_leaves_an_exiting_job_to_exit_0(exiting_job: subprocess.Popen[bytes]) -> None:
    """gdb's script sees the interpreter shutting down before it would call anything, so
    this runs wherever gdb does, where the agent would refuse gdb (AMX) included."""
    if not BEFORE_REMOTE_EXEC:
        pytest.skip("from Python 3.14 the agent injects with sys.remote_exec, not gdb")
    if shutil.which("gdb") is None:
        pytest.skip("gdb is not installed")
    _check_exit_is_untouched(exiting_job, "gdb")


def _own_memory(address: int, size: int) -> bytes:
    return ctypes.string_at(address, size)


@pytest.mark.skipif(sys.version_info < (3, 10), reason="the probe's floor is 3.10")
def test_the_words_say_this_running_interpreter_runs() -> None:
    """Read in the test's own interpreter, which runs: initialized 1, _finalizing NULL
    (and from 3.13 an interpreter at the head of the list)."""
    runtime_state = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
    words = life_words(sys.version_info[:2], runtime_state, _own_memory)
    assert words is not None
    assert not shutting_down(words, _own_memory)
    if words.initialized is not None:
        assert ctypes.c_int.from_address(words.initialized).value == 1
        # and the words around it are what the layout says: core_initialized 1 before it
        assert ctypes.c_int.from_address(words.initialized - 4).value == 1


def test_words_that_say_the_interpreter_is_gone() -> None:
    memory = bytearray(64)

    def read(at: int, size: int) -> bytes:
        return bytes(memory[at:at + size])

    words = life_words((3, 11), 0, read)
    assert words is not None and shutting_down(words, read)  # not yet initialized
    memory[16:20] = (1).to_bytes(4, "little")  # initialized
    assert not shutting_down(words, read)
    memory[24:32] = (0x5555_0000).to_bytes(8, "little")  # _finalizing: a thread state
    assert shutting_down(words, read)
    with pytest.raises(OSError):
        shutting_down(words, lambda at, size: b"")
    # A version with neither a known layout nor debug offsets: nothing is placed
    assert life_words((3, 9), 0, read) is None


def test_from_3_13_the_debug_offsets_place_the_words() -> None:
    # _Py_DebugOffsets: cookie, version, free_threaded, then runtime_state's size,
    # finalizing and interpreters_head
    memory = bytearray(b"xdebugpy" + struct.pack("<QQQQQ", 0x030E00F0, 0, 4096, 2048, 2064))
    memory += bytes(4096 - len(memory))

    def read(at: int, size: int) -> bytes:
        return bytes(memory[at:at + size])

    words = life_words((3, 14), 0, read)
    assert words == LifeWords(2048, None, 2064)
    assert shutting_down(words, read)  # no interpreter at the head
    memory[2064:2072] = (0x5555_0000).to_bytes(8, "little")
    assert not shutting_down(words, read)
    memory[2048:2056] = (0x5555_1000).to_bytes(8, "little")
    assert shutting_down(words, read)
    # Offsets outside the struct: not the layout read here
    memory[40:48] = (1 << 20).to_bytes(8, "little")
    assert life_words((3, 14), 0, read) is None
    assert life_words((3, 14), 0, lambda at, size: b"not the cookie") is None
