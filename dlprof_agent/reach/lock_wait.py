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
caller may not retry.

On 3.13 those waits park in the parking lot (Python/parking_lot.c):
``_PyParkingLot_Park`` waits on a semaphore in ``_PySemaphore_Wait``, which turns
EINTR into Py_PARK_INTR; Park takes itself off the queue (or, where a wake-up is
already on its way, waits for it) and returns that to its caller, and every caller
waits again: PyMutex's slow lock (``_thread.lock.acquire``, under ``Event.wait`` and
``queue.get`` too) first runs ``Py_MakePendingCalls`` where it handles signals, and
``join()`` does so after ``PyEvent_WaitTimed`` (Python/lock.c, Modules/
_threadmodule.c). A real signal to a Python handler ends the same wait the same way:
``sem_wait`` is never restarted after a handler (signal(7)). One wait on that
semaphore does not retry: the parking lot's own raw mutex (``_PyRawMutex_LockSlow``)
ignores the result and would queue itself twice. So the wait is ended only where the
return address right above ``_PySemaphore_Wait``'s frame (its size read from its
prologue) is Park's own call of it.

3.14 has the same callers and the same EINTR handling, but Debian's build (LTO)
calls a copy of Park made for one-byte words (PyMutex, PyEvent), with no symbol of
its own: the copy is the function ``PyEvent_WaitTimed`` calls. A return address
right above ``_PySemaphore_Wait``'s frame after a call of it counts as Park's where
the word right above the copy's frame (its size read from its prologue) follows a
call of that copy: the stack is laid out as that copy's call of
``_PySemaphore_Wait``, whatever called the copy.

On arm64 the frame's size is not read: gcc keeps AAPCS64's frame records (x29, x30),
so the record whose x30 returns into ``_PySemaphore_Wait`` holds in its x29 the
address of that function's own record, whose x30 must follow Park's ``bl`` of it.
Each CPU's place (``cpu``) says which word is the caller's.

The wait is recognised by the system call (a futex wait, or the restart_syscall
that goes on with one after an earlier stop) and by a return address
into ``PyThread_acquire_lock_timed`` (3.9-3.12), or into ``_PySemaphore_Wait`` then
``_PyParkingLot_Park`` (3.13), on the stack just above it, right after a call
instruction."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

from dlprof_agent.reach.stopped import Read, Stopped


class CallSites(Protocol):
    """What of its CPU's place (``cpu``) the wait is recognised by."""

    futex: int
    restart_syscall: int

    def after_a_call(self, read: Read, address: int) -> bool: ...

    def code_address(self, word: int) -> int: ...

    def calls(self, read: Read, address: int, function: int) -> bool:
        """``address`` follows a direct call of ``function``."""
        ...

    def caller_index(self, words: list[int], top: int, index: int, read: Read, callee: int
                     ) -> int | None:
        """``words`` are the stack's from ``top`` up, as code addresses, and
        ``words[index]`` a return address into the function at ``callee``: the index
        of the return address of that function's own call, None where it is unknown."""
        ...

FUTEX = 202
# A wait with a timeout that a ptrace stop interrupted goes on as restart_syscall, its
# registers (the futex's arguments) as they were
RESTART_SYSCALL = 219
_FUTEX_COMMAND = 0x7F  # without FUTEX_PRIVATE_FLAG (128) and FUTEX_CLOCK_REALTIME (256)
_FUTEX_WAITS = frozenset({0, 9})  # FUTEX_WAIT, FUTEX_WAIT_BITSET
EINTR = 4
# From the futex call's stack pointer: libc's futex wrapper, its semaphore wait and
# the semaphore call take a few hundred bytes at most.
STACK_SCAN_BYTES = 1024
_PROLOGUE_BYTES = 48  # of _PySemaphore_Wait: enough for its pushes and its frame


def after_a_call(read: Callable[[int, int], bytes], address: int) -> bool:
    """``address`` follows a call instruction: ``call rel32`` or ``call *disp(%rip)``,
    the two forms a call into libc's semaphore functions takes."""
    try:
        before = read(address - 6, 6)
    except OSError:
        return False
    return len(before) == 6 and (before[1] == 0xE8 or before[:2] == b"\xff\x15")


class ParkingLotWait(NamedTuple):
    """Where 3.13's parking-lot wait is in the job: [start, end) of each function."""

    semaphore_wait: tuple[int, int]  # _PySemaphore_Wait
    park: tuple[int, int]  # _PyParkingLot_Park
    # Copies of Park without a symbol (3.14's LTO build): [entry, entry + twice Park's
    # size), a bound on where its code is
    park_copies: tuple[tuple[int, int], ...] = ()


LockWait = tuple[int, int] | ParkingLotWait  # PyThread_acquire_lock_timed, or 3.13's


def calls(read: Callable[[int, int], bytes], address: int, function: int) -> bool:
    """``address`` follows a ``call rel32`` of ``function``."""
    try:
        before = read(address - 5, 5)
    except OSError:
        return False
    return (len(before) == 5 and before[0] == 0xE8
            and address + int.from_bytes(before[1:], "little", signed=True) == function)


def caller_index(words: list[int], index: int, read: Callable[[int, int], bytes],
                 callee: int) -> int | None:
    """x86-64: the return address of ``callee``'s own call is the word right above its
    frame, whose size its prologue says; None where the prologue is not read."""
    try:
        frame = frame_bytes(read(callee, _PROLOGUE_BYTES))
    except OSError:
        return None
    if frame is None:
        return None
    above = index + 1 + frame // 8
    return above if above < len(words) else None


def _stack_words(cpu: CallSites, stopped: Stopped, read: Callable[[int, int], bytes],
                 stack_end: int) -> list[int]:
    """The words just above the stopped futex wait, nearest first, as code addresses;
    none unless it is one (a futex wait, interrupted by the stop)."""
    if stopped.call not in (cpu.futex, cpu.restart_syscall) or not stopped.interrupted:
        return []
    if (stopped.arguments[1] & _FUTEX_COMMAND) not in _FUTEX_WAITS:
        return []
    return [cpu.code_address(word) for word in _words_from(stopped.sp, read, stack_end)]


def _words_from(stack_pointer: int, read: Callable[[int, int], bytes], stack_end: int
                ) -> list[int]:
    top = stack_pointer & ~7
    size = min(STACK_SCAN_BYTES, stack_end - top)
    if size <= 0:
        return []
    try:
        stack = read(top, size)
    except OSError:
        return []
    return [int.from_bytes(stack[at:at + 8], "little") for at in range(0, len(stack) - 7, 8)]


def in_lock_wait(cpu: CallSites, stopped: Stopped, read: Callable[[int, int], bytes],
                 stack_end: int, lock_function: LockWait) -> bool:
    """The thread, stopped as ``stopped`` says, waits on a futex for
    PyThread_acquire_lock_timed, which lies at [start, end) of ``lock_function``, or
    (a ParkingLotWait) in the parking lot for a caller that retries.
    ``read(address, size)`` reads the job's memory; the stack ends at ``stack_end``."""
    words = _stack_words(cpu, stopped, read, stack_end)
    if isinstance(lock_function, ParkingLotWait):
        return _parked(cpu, stopped.sp & ~7, words, read, lock_function)
    start, end = lock_function
    return any(start < word < end and cpu.after_a_call(read, word) for word in words)


def _parked(cpu: CallSites, top: int, words: list[int], read: Callable[[int, int], bytes],
            wait: ParkingLotWait) -> bool:
    (semaphore, semaphore_end), (park, park_end) = wait.semaphore_wait, wait.park
    for index, word in enumerate(words):
        if not (semaphore < word < semaphore_end and cpu.after_a_call(read, word)):
            continue
        # Found from _PySemaphore_Wait's frame, not searched for: the words between may
        # hold stale return addresses of earlier calls.
        caller = cpu.caller_index(words, top, index, read, semaphore)
        if caller is None or not cpu.calls(read, words[caller], semaphore):
            continue
        if park < words[caller] < park_end or _in_a_park_copy(
                cpu, top, words, caller, read, copies=wait.park_copies):
            return True
    return False


def _in_a_park_copy(cpu: CallSites, top: int, words: list[int], at: int,
                    read: Callable[[int, int], bytes], *,
                    copies: tuple[tuple[int, int], ...]) -> bool:
    """``words[at]`` is a return address in one of ``copies``: it lies where that
    copy's code may, and the copy's own return address follows a call of it."""
    for copy, bound in copies:
        if not copy < words[at] < bound:
            continue
        caller = cpu.caller_index(words, top, at, read, copy)
        if caller is not None and cpu.calls(read, words[caller], copy):
            return True
    return False


def waits_in_parking_lot(cpu: CallSites, syscall: list[str], read: Callable[[int, int], bytes],
                         stack_end: int, wait: ParkingLotWait) -> bool:
    """A thread, as its /proc/<pid>/task/<tid>/syscall line (split) shows it without
    stopping it, waits on a futex in the parking lot for a caller that retries: the
    agent's guess before it decides how to reach the job; the injector checks again
    on the stopped thread."""
    if len(syscall) < 9 or syscall[0] != str(cpu.futex):
        return False
    try:
        command, stack_pointer = int(syscall[2], 16), int(syscall[7], 16)
    except ValueError:
        return False
    if (command & _FUTEX_COMMAND) not in _FUTEX_WAITS:
        return False
    words = [cpu.code_address(word) for word in _words_from(stack_pointer, read, stack_end)]
    return _parked(cpu, stack_pointer & ~7, words, read, wait)


def frame_bytes(code: bytes) -> int | None:
    """The bytes a function's prologue, ``code``, puts on the stack below its return
    address (pushes, then ``sub $n, %rsp``), as gcc and clang write it for x86-64;
    None for any instruction other than those and register moves."""
    at, pushed = 0, 0
    while at < len(code):
        rest = code[at:]
        if rest[:4] == b"\xf3\x0f\x1e\xfa":  # endbr64
            at += 4
        elif 0x50 <= rest[0] <= 0x57:  # push %rax..%rdi
            pushed, at = pushed + 8, at + 1
        elif rest[0] == 0x41 and len(rest) > 1 and 0x50 <= rest[1] <= 0x57:  # %r8..%r15
            pushed, at = pushed + 8, at + 2
        elif rest[:3] == b"\x48\x83\xec" and len(rest) >= 4:  # sub $imm8, %rsp
            return pushed + rest[3]
        elif rest[:3] == b"\x48\x81\xec" and len(rest) >= 7:  # sub $imm32, %rsp
            return pushed + int.from_bytes(rest[3:7], "little")
        elif _register_move(rest):
            at += _register_move(rest)
        elif _register_clear(rest):  # xor %eax,%eax, and mov $imm32 to a register
            at += _register_clear(rest)
        else:
            return None
    return None


def _register_move(code: bytes) -> int:
    """The length of a ``mov`` between registers, or of an immediate to a register,
    at the start of ``code``; 0 for anything else."""
    rex = 1 if code and 0x40 <= code[0] <= 0x4F else 0
    if len(code) < rex + 2 or code[rex + 1] >> 6 != 3:
        return 0
    if code[rex] in (0x89, 0x8B):
        return rex + 2
    if code[rex] == 0xC7 and code[rex + 1] >> 3 & 7 == 0:
        return rex + 6 if len(code) >= rex + 6 else 0
    return 0


def _register_clear(code: bytes) -> int:
    """The length of ``xor`` of two registers, or of ``mov $imm32`` to a 32-bit
    register, at the start of ``code``; 0 for anything else."""
    rex = 1 if code and 0x40 <= code[0] <= 0x47 else 0  # not REX.W: imm32, not imm64
    if len(code) < rex + 2:
        return 0
    if code[rex] in (0x31, 0x33) and code[rex + 1] >> 6 == 3:
        return rex + 2
    if 0xB8 <= code[rex] <= 0xBF and len(code) >= rex + 5:
        return rex + 5
    return 0


def call_targets(start: int, code: bytes) -> list[int]:
    """The targets of what may be a ``call rel32`` in ``code`` (at ``start``): each is
    only a candidate, checked on the stack against its caller and its frame."""
    return [start + at + 5 + int.from_bytes(code[at + 1:at + 5], "little", signed=True)
            for at in range(len(code) - 4) if code[at] == 0xE8]
