"""Where a busy main thread may be stopped to queue the probe (``reach/safe_point.py``):
PCs in other libraries or in the eval loop's own code only, and never inside a signal
handler."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from dlprof_agent.collectors.target import Target
from dlprof_agent.reach.elf import scan_elf_file
from dlprof_agent.reach.runtime import find_python_runtime
from dlprof_agent.reach.safe_point import (
    HANDLER_SCAN_BYTES,
    BusyStops,
    in_signal_handler,
    safe_pc,
)

PYTHON = "/usr/bin/python3.11"
MAPS = [
    (0x400000, 0x800000, "r-xp", 0, PYTHON),
    (0x7F0000000000, 0x7F0000100000, "r-xp", 0, "/opt/torch/lib/libtorch_cpu.so"),
    (0x7F0000200000, 0x7F0000300000, "r-xp", 0, "/usr/lib/x86_64-linux-gnu/libc.so.6"),
    (0x7F0000400000, 0x7F0000500000, "r-xp", 0, "/usr/lib/libpython3.11.so.1.0"),
    (0x7F0000600000, 0x7F0000601000, "r-xp", 0, "[vdso]"),
    (0x7F0000700000, 0x7F0000701000, "rwxp", 0, ""),
    (0x7F0000800000, 0x7F0000900000, "r--p", 0, "/opt/torch/lib/libtorch_cpu.so"),
    (0x7F0000A00000, 0x7F0000B00000, "r-xp", 0, "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"),
]
INTERPRETER = frozenset({PYTHON, "/usr/lib/libpython3.11.so.1.0"})


def test_only_other_libraries_code_is_a_safe_pc() -> None:
    assert safe_pc(0x7F0000000100, MAPS, INTERPRETER)  # libtorch's code
    for pc in (0x400100,  # the interpreter
               0x7F0000200100,  # libc
               0x7F0000400100,  # libpython
               0x7F0000600100,  # the vdso
               0x7F0000700100,  # anonymous (JIT) code
               0x7F0000800100,  # not executable
               0x7F0000A00100,  # the dynamic loader
               0x10):  # nothing mapped
        assert not safe_pc(pc, MAPS, INTERPRETER), hex(pc)


def test_a_restorer_address_above_the_stack_pointer_is_a_handler_in_progress() -> None:
    restorer = 0x7F0000200500
    rsp, end = 0x7FFE0000, 0x7FFF0000
    stack = bytearray(end - rsp)

    def read(address: int, size: int) -> bytes:
        return bytes(stack[address - rsp:address - rsp + size])

    assert not in_signal_handler(read, rsp, end, restorer)
    stack[0x800:0x808] = restorer.to_bytes(8, "little")
    assert in_signal_handler(read, rsp, end, restorer)
    stack[0x800:0x808] = bytes(8)
    stack[HANDLER_SCAN_BYTES + 8:HANDLER_SCAN_BYTES + 16] = restorer.to_bytes(8, "little")
    assert not in_signal_handler(read, rsp, end, restorer), "further up than a handler's frame"

    def unreadable(address: int, size: int) -> bytes:
        raise OSError("gone")

    assert in_signal_handler(unreadable, rsp, end, restorer), "unknown is taken as unsafe"


EVAL_LOOP = (0x7F0000400800, 0x7F0000410000)  # _PyEval_EvalFrameDefault, in libpython


def test_the_eval_loop_own_code_is_a_safe_pc_and_the_rest_of_python_is_not() -> None:
    assert safe_pc(0x7F0000400800, MAPS, INTERPRETER, EVAL_LOOP)  # its first instruction
    assert safe_pc(0x7F000040FFFF, MAPS, INTERPRETER, EVAL_LOOP)
    assert safe_pc(0x7F0000000100, MAPS, INTERPRETER, EVAL_LOOP)  # libtorch's, still
    for pc in (0x7F00004007FF,  # just before it: another libpython function
               0x7F0000410000,  # just past it (its end is not its own)
               0x7F0000200100,  # libc
               0x400100):  # the interpreter's executable
        assert not safe_pc(pc, MAPS, INTERPRETER, EVAL_LOOP), hex(pc)
    assert not safe_pc(0x7F0000400900, MAPS, INTERPRETER), "no extent: libpython is unsafe"
    # An extent that is no executable code of the job is not trusted
    assert not safe_pc(0x7F0000800100, MAPS, INTERPRETER, (0x7F0000800000, 0x7F0000900000))
    stops = BusyStops(INTERPRETER, EVAL_LOOP)
    assert stops.accepts(0x7F0000400900, MAPS)
    assert not stops._replace(eval_loop=None).accepts(0x7F0000400900, MAPS)


# What the eval loop's own code must never call directly: the pending-call lock's
# acquire and release, and the locks under them (then a stop there could be inside its
# critical section)
LOCK_CALLS = re.compile(r"\b(call|bl)\s.*<(PyThread_acquire_lock|PyThread_release_lock|sem_|"
                        r"pthread_mutex_lock|PyMutex_Lock|_PyMutex_LockSlow|_pop_pending_call)")


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump")
def test_the_eval_loop_of_this_interpreter_takes_no_lock_in_its_own_code() -> None:
    """The rule rests on how CPython is compiled: on this interpreter, the pending-call
    lock is taken only in functions the eval loop calls, none inlined into it (x86-64's
    ``call``, arm64's ``bl``)."""
    runtime = find_python_runtime(Target.of(os.getpid()))
    assert runtime is not None
    library = runtime.library
    scan = scan_elf_file(library)
    location = scan.location("_PyEval_EvalFrameDefault") if scan is not None else None
    size = scan.size("_PyEval_EvalFrameDefault") if scan is not None else None
    if scan is None or location is None or not size:
        pytest.skip(f"{library} exports no _PyEval_EvalFrameDefault with a size")
    start = location[0]
    code = subprocess.run(["objdump", "-d", f"--start-address={start:#x}",
                           f"--stop-address={start + size:#x}", library],
                          capture_output=True, text=True, check=True).stdout
    calls = [line for line in code.splitlines() if re.search(r"\t(call|bl)\s", line)]
    assert calls, "objdump gave no code"
    assert not [line for line in calls if LOCK_CALLS.search(line)]
