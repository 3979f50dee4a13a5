"""Where a busy thread, one that never waits in the kernel, may be stopped and
made to call ``mmap`` and ``Py_AddPendingCall``: at an instruction of a library
that neither of them can be waiting for, or of the eval loop itself.

Py_AddPendingCall is not async-signal-safe (CPython says so of
``_PyEval_SignalReceived``): it takes the pending-call lock, so a thread stopped
inside that lock's critical section, which is in libpython, would wait for
itself. ``mmap`` is one system call, but a thread stopped inside libc or the
dynamic loader may hold their locks, and the vdso is libc's too. So the stop is
accepted only at a PC in another file-backed executable mapping (libtorch,
oneDNN, MKL, an extension module's own code), and only with no signal handler
in progress on the thread's stack (no return address into libc's signal
restorer above it): a handler could have interrupted any of those. A stop
anywhere else is released at once and tried again after a short random delay.

A pure-Python loop spends its time in libpython. Its safe point is the body of
``_PyEval_EvalFrameDefault`` (its extent from .dynsym, checked against the file), not a
function it calls, with the same signal-handler rule. Up to 3.12 the pending-call lock
is taken only by ``Py_AddPendingCall`` and by the loop's callees that run pending calls
(``make_pending_calls``, ``_Py_HandlePending``, ``Py_MakePendingCalls``, reached through
a call, as the GIL's drop and take are), and the loop's own code holds no libc lock;
Py_AddPendingCall needs no GIL there. Read so in the machine code of 3.10, 3.11 (built
from source, and Debian's optimised build), 3.12 and Debian trixie's 3.13: the loop calls
those functions, none is inlined into it; ``tests/test_safe_point.py`` checks the
interpreter it runs on. No other function qualifies: the allocator, dict lookups and
integer arithmetic that fill the rest of such a loop are many small static functions,
none exported with a size, each one more thing to reason about. 3.13's pending-call
PyMutex parks a contended caller and releases its GIL, which mid-bytecode would let
another thread run into a half-done instruction: there the main thread is borrowed busy
only with every other thread of the job stopped and that mutex free, until its call is
queued (``pending_mutex``). A random stop of a pinned loop summing integers in a function lands in
the eval loop's own code 31-57% of the time (3.10-3.12; 19% at module level on 3.11,
where the globals' dict lookups are callees), and such a loop runs queued code within
0.3 s.

The frame the stopped thread returns through holds its whole XSAVE state
(``frame``), so AVX registers live in the interrupted kernel survive."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

from dlprof_agent.collectors.procfs import Mapping

# Files whose code the calls themselves use, or that hold the locks they take
_UNSAFE_PREFIXES = ("libpython", "libc.so", "libc-", "ld-linux", "ld-musl", "ld.so",
                    "libpthread", "libdl")
# From the stopped PC's stack pointer: how far up a signal handler's frame is looked for
HANDLER_SCAN_BYTES = 32 << 10


def safe_pc(pc: int, maps: list[Mapping], unsafe_files: frozenset[str],
            eval_loop: tuple[int, int] | None = None) -> bool:
    """``pc`` is in a file-backed executable mapping of a library the calls do not
    use: not the interpreter (``unsafe_files``: its executable and libpython), libc,
    the dynamic loader, the vdso, nor anonymous (JIT) code; or it is in ``eval_loop``
    ([start, end) of _PyEval_EvalFrameDefault), in executable code."""
    mapping = next((m for m in maps if m[0] <= pc < m[1]), None)
    if mapping is None:
        return False
    _, _, permissions, _, path = mapping
    if "x" in permissions and eval_loop is not None and eval_loop[0] <= pc < eval_loop[1]:
        return True
    if "x" not in permissions or not path.startswith("/") or path in unsafe_files:
        return False
    return not os.path.basename(path).startswith(_UNSAFE_PREFIXES)


def in_signal_handler(read: Callable[[int, int], bytes], sp: int, stack_end: int,
                      restorer: int, code_address: Callable[[int], int] = int) -> bool:
    """A word on the stack above ``sp`` is the address of the signal restorer (libc's,
    or the vDSO's on arm64): the thread is inside a signal handler (or the stack
    cannot be read: taken as such). ``code_address`` takes a stored return address's
    authentication code off (arm64's PAC)."""
    top = sp & ~7
    size = min(HANDLER_SCAN_BYTES, stack_end - top)
    if size <= 0:
        return True
    try:
        stack = read(top, size)
    except OSError:
        return True
    return any(code_address(int.from_bytes(stack[at:at + 8], "little")) == restorer
               for at in range(0, len(stack) - 7, 8))


class BusyStops(NamedTuple):
    """Where a busy main thread of one job may be stopped: ``safe_pc`` with these."""

    unsafe_files: frozenset[str]  # the interpreter's executable and libpython
    eval_loop: tuple[int, int] | None  # [start, end) of _PyEval_EvalFrameDefault, if known
    # 3.13: the pending-call mutex (``pending_mutex``); a busy main thread is then borrowed
    # only with the job's other threads stopped and this mutex free
    pending_mutex: int | None = None

    def accepts(self, pc: int, maps: list[Mapping]) -> bool:
        return safe_pc(pc, maps, self.unsafe_files, self.eval_loop)
