"""The one wait of a job's main thread that the ptrace injector ends early, with
EINTR, as a signal without SA_RESTART would: CPython's lock wait.

CPython runs pending calls on the main thread only, between two bytecodes, so a
probe queued while the main thread waits (``join()``, ``lock.acquire``,
``Event.wait``, ``queue.get``) would wait as long as the job does. On 3.9-3.12
all of those wait in ``PyThread_acquire_lock_timed`` (Python/thread_pthread.h),
on a semaphore: a wait that EINTR ends is waited again there (``intr_flag`` 0),
or returned as PY_LOCK_INTR to ``acquire_timed`` (Modules/_threadmodule.c),
which runs ``Py_MakePendingCalls`` and waits again for what is left of its
timeout. Either way the caller retries, so ending that wait changes nothing but
when the queued probe runs. Any other wait (``sleep``, ``select``, ``recv``, a
C library's own condition variable) is restarted as before, never ended: its
caller may not retry. 3.13's lock objects wait in PyMutex's parking lot instead,
which is not recognised here: there the probe is only queued.

The wait is recognised by the system call (a futex wait, or the restart_syscall
that goes on with one after an earlier stop) and by a return address
into ``PyThread_acquire_lock_timed`` on the stack just above it, right after a
call instruction."""

from __future__ import annotations

from collections.abc import Callable

FUTEX = 202
# A wait with a timeout that a ptrace stop interrupted goes on as restart_syscall, its
# registers (the futex's arguments) as they were
RESTART_SYSCALL = 219
_FUTEX_COMMAND = 0x7F  # without FUTEX_PRIVATE_FLAG (128) and FUTEX_CLOCK_REALTIME (256)
_FUTEX_WAITS = frozenset({0, 9})  # FUTEX_WAIT, FUTEX_WAIT_BITSET
# How the kernel leaves a futex wait that a ptrace stop interrupted: ERESTARTSYS
# (no timeout, or an absolute one), ERESTART_RESTARTBLOCK (a timeout it resumes)
_INTERRUPTED_FUTEX = frozenset({-512, -516})
EINTR = 4
# From the futex call's stack pointer: libc's futex wrapper, its semaphore wait and
# the semaphore call take a few hundred bytes at most.
STACK_SCAN_BYTES = 1024


def _signed(register: int) -> int:
    return register - (1 << 64) if register >= 1 << 63 else register


def _after_a_call(read: Callable[[int, int], bytes], address: int) -> bool:
    """``address`` follows a call instruction: ``call rel32`` or ``call *disp(%rip)``,
    the two forms a call into libc's semaphore functions takes."""
    try:
        before = read(address - 6, 6)
    except OSError:
        return False
    return len(before) == 6 and (before[1] == 0xE8 or before[:2] == b"\xff\x15")


def in_lock_wait(registers: dict[str, int], read: Callable[[int, int], bytes],
                 stack_end: int, lock_function: tuple[int, int]) -> bool:
    """The thread, stopped with ``registers``, waits on a futex for
    PyThread_acquire_lock_timed, which lies at [start, end) of ``lock_function``.
    ``read(address, size)`` reads the job's memory; the stack ends at ``stack_end``."""
    if _signed(registers["orig_rax"]) not in (FUTEX, RESTART_SYSCALL) or _signed(
            registers["rax"]) not in _INTERRUPTED_FUTEX:
        return False
    if (registers["rsi"] & _FUTEX_COMMAND) not in _FUTEX_WAITS:
        return False
    start, end = lock_function
    top = registers["rsp"] & ~7
    size = min(STACK_SCAN_BYTES, stack_end - top)
    if size <= 0:
        return False
    try:
        stack = read(top, size)
    except OSError:
        return False
    for at in range(0, len(stack) - 7, 8):
        word = int.from_bytes(stack[at:at + 8], "little")
        if start < word < end and _after_a_call(read, word):
            return True
    return False
