"""The agent's own injector on x86-64: it borrows one thread of the job that waits in
the kernel, has it call a function, and the thread puts itself back.

The agent is the tracer, and stops one thread only, one that waits in the kernel in a
system call that leaves the signal mask alone (``threads``), or, where none does, the
busy main thread at a safe PC, another library's or the eval loop's (``safe_point``). With
PTRACE_SEIZE and PTRACE_INTERRUPT no signal is sent, so a tracer that dies leaves the
thread running as before. The agent writes, below the thread's red zone, a signal frame
(``frame``) holding the thread's registers and its whole XSAVE state, cut to the
thread's own layout as CPUID gives it (AVX, AVX-512, PKRU, AMX where the thread uses
it; its interrupted call set to be restarted, as the kernel does after a ptrace stop),
and sets all registers at once so that the thread calls the function and returns into
an ``rt_sigreturn`` of libc: the kernel puts the thread back exactly where it was. From
then on the thread needs nothing from the agent: the agent may die at any instant and no
trap, no breakpoint, no stopped thread is ever left. While the agent lives, it follows
the thread (PTRACE_SYSCALL) to the end of that rt_sigreturn, compares the register
state there with the one it saved, and puts any difference back with PTRACE_SETREGSET:
the frame is what survives the agent's death, ptrace what checks it. Where the frame
cannot hold the whole state, nothing is borrowed (``InjectionUnsafe``).

It is done twice: ``mmap`` (a page for the code, at a free address with
MAP_FIXED_NOREPLACE, Linux 4.17+), then the agent writes the code there through
/proc/<pid>/mem, then ``Py_AddPendingCall(PyRun_SimpleString, page)``. Each address
called is checked first to hold the bytes of that function in its file.

A thread stopped in a call the kernel would resume through ``restart_syscall`` (relative
sleeps, waits with a timeout) is not borrowed: rt_sigreturn would turn that resumption
into EINTR. The one exception is the main thread in CPython's lock wait (``lock_wait``):
that wait is ended with EINTR on purpose, whatever its timeout, since its caller waits
again and, on the way, runs the pending call just queued.

A busy 3.13 main thread is borrowed only with the job's other threads stopped, from
before its registers are set until it reaches its ``rt_sigreturn`` (at most 0.5 s),
and only with the pending-call mutex free (``pending_mutex``): its Py_AddPendingCall
then never waits, and never lets go of the GIL in the middle of a bytecode.

What may differ for the borrowed thread: a wait for the 3.13 pending-call mutex itself
(another thread adding a pending call at that very moment) could be lengthened.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import mmap
import os
import random
import signal
import time
from collections.abc import Callable
from typing import NamedTuple

from dlprof_agent.collectors.procfs import (
    PROC_ROOT,
    Mapping,
    executable_path,
    open_memory,
    read_executable,
)
from dlprof_agent.errors import InjectionFailed, InjectionNotNow, TargetGone
from dlprof_agent.reach import progress
from dlprof_agent.reach.elf import scan_elf_file
from dlprof_agent.reach.frame import (
    REGISTERS,
    StateNotKept,
    frame_state_bytes,
    signal_frame,
    signed,
)
from dlprof_agent.reach.lock_wait import LockWait, ParkingLotWait, call_targets, in_lock_wait
from dlprof_agent.reach.mapped_files import (
    data_address,
    free_address,
    function_address,
    libc_path,
    mapped_file_paths,
)
from dlprof_agent.reach.pending import (
    ADDRESS_PLACEHOLDER,
    FLAG_BYTES,
    QueuedBootstrap,
    pending_payload,
    remember,
)
from dlprof_agent.reach.pending_mutex import pending_mutex_address
from dlprof_agent.reach.procfs import memory_map, start_ticks
from dlprof_agent.reach.refusal import refused
from dlprof_agent.reach.register_state import Detour, cpu_layout, put_back, unsafe
from dlprof_agent.reach.runtime import PythonRuntime
from dlprof_agent.reach.safe_point import BusyStops, in_signal_handler
from dlprof_agent.reach.threads import (
    POLL_SECONDS,
    blocked_signals,
    borrowable,
    exited_during_injection,
    no_safe_point,
    same_process,
    waiting_threads,
)
from dlprof_agent.reach.tracer import (
    PTRACE_EVENT_STOP,
    PTRACE_INTERRUPT,
    PTRACE_SEIZE,
    WALL,
    Tracer,
    hold_other_threads,
    release,
    until_it_returns,
)

_MAP_FIXED_NOREPLACE = 0x100000  # Linux 4.17+: never replaces a mapping of the job
# mov $15,%rax; syscall (and the %eax form): rt_sigreturn, as libc's signal restorer does it
_SIGRETURN = (b"\x48\xc7\xc0\x0f\x00\x00\x00\x0f\x05", b"\xb8\x0f\x00\x00\x00\x0f\x05")
# A call the kernel resumes through restart_syscall (a relative sleep, a futex or poll
# with a timeout) is never borrowed: rt_sigreturn turns that resumption into EINTR.
_ERESTART_RESTARTBLOCK = -516
_SYSCALL_ARGUMENTS = ("rdi", "rsi", "rdx", "r10", "r8", "r9")
_CALL_ARGUMENTS = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")
_RED_ZONE = 128
_FRAME_GAP = 2048  # below the red zone: where the borrowed thread's detour frame goes
_STACK_NEEDED = 64 << 10  # free stack the called function may use below the frame
_CHAIN_SECONDS = 5.0  # for a borrowed thread to be scheduled and finish its detour
# How long the pending call waits for the main thread itself: CPython runs pending calls
# only there, and from another thread 3.10-3.12 tell it only when it next takes the GIL,
# which a main thread in a lock wait may not do for hours.
_PREFER_MAIN_SECONDS = 0.5
_MAX_CODE_BYTES = 64 << 20  # an executable mapping of libc larger than this is not searched


def _read_memory(pid: int, address: int, size: int) -> bytes:
    with open_memory(pid) as memory:
        memory.seek(address)
        return memory.read(size)


def _write_memory(pid: int, address: int, data: bytes) -> None:
    with open_memory(pid, writable=True) as memory:
        memory.seek(address)
        if memory.write(data) != len(data):
            raise OSError(f"short write to process {pid}")


def _find_sigreturn(pid: int, maps: list[Mapping], libc: str) -> int | None:
    for start, end, permissions, _, path in maps:
        if path != libc or "x" not in permissions or end - start > _MAX_CODE_BYTES:
            continue
        try:
            code = _read_memory(pid, start, end - start)
        except OSError:
            continue
        for gadget in _SIGRETURN:
            at = code.find(gadget)
            if at >= 0:
                return start + at
    return None


def _detour(ptrace: Tracer, pid: int, tid: int, call: tuple[int, tuple[int, ...], int],
            maps: list[Mapping], *, lock_function: LockWait | None = None,
            busy: BusyStops | None = None,
            hold_others: Callable[[], bool] | None = None) -> Detour | None:
    """With ``tid`` stopped by us: point it at ``function(*args)``, returning into
    rt_sigreturn with a frame that restores it. Leaves it untouched and returns None
    when it is not waiting in a system call we may borrow it from; raises
    InjectionUnsafe where the frame cannot hold its whole register state. ``call`` is the
    function's address, its arguments, and the address of an rt_sigreturn. The main
    thread waiting for a lock in ``lock_function`` (PyThread_acquire_lock_timed's
    extent, or 3.13's parking lot) comes back from its wait with EINTR, so that it runs
    a pending call now.
    With ``busy``, a thread stopped outside any system call is taken too, at a safe PC
    (``safe_point``), once ``hold_others`` (where given) has stopped the job's other
    threads and said yes."""
    function, args, gadget = call
    regs = ptrace.registers(tid)
    r = dict(zip(REGISTERS, regs, strict=True))
    orig = signed(r["orig_rax"])
    arguments = [r[name] for name in _SYSCALL_ARGUMENTS]
    stack = next(((start, end) for start, end, *_ in maps if start <= r["rsp"] < end), None)
    interrupt = (tid == pid and lock_function is not None and stack is not None
                 and in_lock_wait(r, lambda address, size: _read_memory(pid, address, size),
                                  stack[1], lock_function))
    if orig < 0:
        if busy is None or stack is None or not busy.accepts(r["rip"], maps) or (
                in_signal_handler(lambda address, size: _read_memory(pid, address, size),
                                  r["rsp"], stack[1], gadget)) or (
                hold_others is not None and not hold_others()):
            return None
    elif not interrupt and (not borrowable(orig, arguments)
                            or signed(r["rax"]) == _ERESTART_RESTARTBLOCK):
        return None
    layout = cpu_layout(pid)
    blocked = blocked_signals(pid, tid)
    xstate = ptrace.xstate(tid)
    gap = max(_FRAME_GAP, 8 + 304 + 64 + frame_state_bytes(xstate) + 64)
    at = ((r["rsp"] - _RED_ZONE - gap) & ~15) - 8  # a call's entry: rsp % 16 == 8
    if blocked is None or stack is None or at - _STACK_NEEDED < stack[0]:
        return None
    try:
        frame = signal_frame(at, regs, ptrace.fxsave(tid), blocked, gadget,
                             interrupt=interrupt, xstate=xstate, layout=layout)
    except StateNotKept as error:
        raise unsafe(pid, f"thread {tid}: {error}") from None
    if at + len(frame) > r["rsp"] - _RED_ZONE:
        return None
    _write_memory(pid, at, frame)
    # The direction flag cleared, as a call requires and the kernel does for a handler:
    # a busy thread may be stopped inside a backward string copy.
    new = dict(r, rsp=at, rip=function, rax=0, orig_rax=(1 << 64) - 1,
               eflags=r["eflags"] & ~0x400)
    for register, value in zip(_CALL_ARGUMENTS, args, strict=False):
        new[register] = value % (1 << 64)
    ptrace.set_registers(tid, [new[name] for name in REGISTERS])
    return Detour(at + 8, xstate, layout)  # rt_sigreturn runs with the gadget popped


def _borrow_a_thread(ptrace: Tracer, pid: int, function: int, args: tuple[int, ...],
                     gadget: int, *, lock_function: LockWait | None = None,
                     busy: BusyStops | None = None, main_only: bool = False) -> bool:
    """Have one waiting thread of ``pid`` call ``function(*args)`` and go back to its wait.
    Only that thread stops, for microseconds at a time; it needs nothing more from us
    once it is set on its way, so the agent may die at any moment. False when none could be had.
    Where none waits (or with ``main_only``, where the main thread does not), the main
    thread is taken busy, at a safe PC, given ``busy``: it runs the pending call itself."""
    maps = memory_map(pid)
    waiting = waiting_threads(pid)
    if main_only:
        candidates = [pid] if pid in waiting or busy is not None else []
        busy = None if pid in waiting else busy
    else:
        candidates = waiting or ([pid] if busy is not None else [])
        busy = None if waiting else busy
    for tid in candidates:
        try:
            ptrace(PTRACE_SEIZE, tid)
        except OSError as error:
            if error.errno == errno.EPERM:
                raise refused(pid, PROC_ROOT, "ptrace was denied") from None
            continue
        stopped, signal_to_pass = False, 0
        held: dict[int, int] = {}  # other threads stopped meanwhile -> a signal to pass on
        mutex = busy.pending_mutex if busy is not None and tid == pid else None
        try:
            ptrace(PTRACE_INTERRUPT, tid)
            _, status = os.waitpid(tid, WALL)
            if not os.WIFSTOPPED(status):
                continue
            stopped = True
            if status >> 16 != PTRACE_EVENT_STOP:
                signal_to_pass = os.WSTOPSIG(status)  # a signal arrived meanwhile: pass it on
                continue
            if os.WSTOPSIG(status) != signal.SIGTRAP:
                continue  # a group stop (someone stopped the job): leave it as it is
            hold = None if mutex is None else functools.partial(
                _hold_with_the_mutex_free, ptrace, pid, held, mutex)
            detour = _detour(ptrace, pid, tid, (function, args, gadget), maps,
                             lock_function=lock_function, busy=busy, hold_others=hold)
            if detour is not None:
                # Its call is set: whatever happens now, it is done, and its frame
                # restores it. While the agent lives, it follows the thread to its
                # frame's rt_sigreturn and checks what came back.
                with contextlib.suppress(OSError, ChildProcessError):
                    signal_to_pass, returned = until_it_returns(ptrace, tid,
                                                                detour.sigreturn_rsp)
                    if returned:
                        put_back(ptrace, pid, tid, detour)
                return True
        except OSError:
            continue
        finally:
            release(ptrace, tid, stopped, signal_to_pass)
            for other, its_signal in held.items():
                release(ptrace, other, True, its_signal)
    return False


def _hold_with_the_mutex_free(ptrace: Tracer, pid: int, held: dict[int, int], mutex: int
                              ) -> bool:
    """Every other thread of ``pid`` held, and 3.13's pending-call PyMutex at ``mutex``
    free: its byte 0, unlocked with no waiter parked."""
    try:
        return hold_other_threads(ptrace, pid, held) and _read_memory(pid, mutex, 1) == b"\0"
    except OSError:
        return False


class CallAddresses(NamedTuple):
    """Where, in the job, the functions the injector has a thread call are; each
    checked to hold the bytes of that function in its file."""

    add_pending_call: int  # Py_AddPendingCall
    run_simple_string: int  # PyRun_SimpleString
    mmap: int  # libc's
    sigreturn: int  # an rt_sigreturn of libc's signal restorer
    # [start, end) of PyThread_acquire_lock_timed, or 3.13's parking-lot wait: the main
    # thread's wait there is ended with EINTR (``lock_wait``); None where it cannot be
    # found and checked
    lock_wait: LockWait | None = None
    # Where a busy main thread may be stopped (``safe_point``); None: a busy thread is not
    # borrowed (3.13's pending-call mutex may release the caller's GIL; an unknown version)
    busy_stops: BusyStops | None = None


def plan_calls(pid: int, runtime: PythonRuntime) -> CallAddresses | None:
    """Addresses in ``pid`` of Py_AddPendingCall, PyRun_SimpleString, mmap and an
    rt_sigreturn; None when one cannot be found and checked (then gdb is used)."""
    maps = memory_map(pid)
    libc = libc_path(maps)
    if libc is None:
        return None
    try:
        exe = read_executable(pid)
    except TargetGone:
        return None
    if exe is None:
        return None
    # Every file through the job's root (``mapped_files``): a job in a chroot or a
    # container has its own libc, never the agent's.
    python_files = ([executable_path(pid)] if runtime.library == exe
                    else mapped_file_paths(pid, runtime.library, maps))
    add = function_address(pid, maps, runtime.library, python_files, "Py_AddPendingCall")
    run = function_address(pid, maps, runtime.library, python_files, "PyRun_SimpleString")
    allocate = function_address(pid, maps, libc, mapped_file_paths(pid, libc, maps), "mmap")
    gadget = _find_sigreturn(pid, maps, libc)
    if add is None or run is None or allocate is None or gadget is None:
        return None
    # Up to 3.12; 3.13 only where its pending-call mutex is found (``pending_mutex``)
    mutex = (_pending_mutex(pid, maps, runtime.library, python_files)
             if runtime.version == (3, 13) else None)
    busy = (BusyStops(frozenset({runtime.library, exe}),
                      _function_extent(pid, maps, runtime.library, python_files,
                                       "_PyEval_EvalFrameDefault"), mutex)
            if runtime.version is not None and (runtime.version < (3, 13) or mutex is not None)
            else None)
    lock_wait: LockWait | None = (
        _parking_lot_wait(pid, maps, runtime.library, python_files)
        if runtime.version in PARKING_LOT_VERSIONS else
        _function_extent(pid, maps, runtime.library, python_files,
                         "PyThread_acquire_lock_timed")
        if runtime.version is not None and runtime.version < (3, 13) else None)
    return CallAddresses(add, run, allocate, gadget, lock_wait, busy)


PARKING_LOT_VERSIONS = ((3, 13), (3, 14))  # whose lock waits were read (``lock_wait``)


def _pending_mutex(pid: int, maps: list[Mapping], path: str, files: list[str]) -> int | None:
    """3.13's main-thread pending-call mutex in ``pid`` (``pending_mutex``), or None."""
    runtime_state = data_address(pid, maps, path, files, "_PyRuntime")
    adder = _function_extent(pid, maps, path, files, "_PyEval_AddPendingCall")
    if runtime_state is None or adder is None:
        return None
    try:
        code = _read_memory(pid, adder[0], adder[1] - adder[0])
    except OSError:
        return None
    return pending_mutex_address(runtime_state, code, adder[0])


def _parking_lot_wait(pid: int, maps: list[Mapping], path: str, files: list[str]
                      ) -> ParkingLotWait | None:
    semaphore_wait = _function_extent(pid, maps, path, files, "_PySemaphore_Wait")
    park = _function_extent(pid, maps, path, files, "_PyParkingLot_Park")
    event_wait = _function_extent(pid, maps, path, files, "PyEvent_WaitTimed")
    if semaphore_wait is None or park is None:
        return None
    # The copy of Park that PyEvent_WaitTimed calls (3.14), where it is not Park itself
    at, code = event_wait[0] if event_wait else 0, b""
    with contextlib.suppress(OSError):
        code = _read_memory(pid, at, event_wait[1] - at) if event_wait else b""
    bound = 2 * (park[1] - park[0])
    return ParkingLotWait(semaphore_wait, park, tuple(
        (copy, copy + bound) for copy in sorted(set(call_targets(at, code)) - {park[0]})
        if any(start <= copy < end and "x" in rights for start, end, rights, *_ in maps)))


def _function_extent(pid: int, maps: list[Mapping], path: str, files: list[str],
                     name: str) -> tuple[int, int] | None:
    """[start, end) of function ``name`` in ``pid``, checked as _function_address is."""
    start = function_address(pid, maps, path, files, name)
    if start is None:
        return None
    for file in files:
        with contextlib.suppress(PermissionError):
            scan = scan_elf_file(file)
            if scan is not None:
                size = scan.size(name)
                return (start, start + size) if size else None
    return None


def inject_with_ptrace(pid: int, code: str, calls: CallAddresses, wait_seconds: float
                       ) -> QueuedBootstrap:
    """Queue ``code`` as a pending call in ``pid``: a borrowed thread maps a page, the
    agent writes the code there, and a borrowed thread queues it."""
    start_time = start_ticks(pid)
    payload = pending_payload(code)
    size = -(-len(payload) // mmap.PAGESIZE) * mmap.PAGESIZE
    ptrace = Tracer()
    deadline = time.monotonic() + wait_seconds

    def borrow_once(function: int, args: tuple[int, ...], *, pending: bool,
                    main_until: float) -> bool:
        if pending:  # the main thread, for a while: from another the call may wait long
            return _borrow_a_thread(ptrace, pid, function, args, calls.sigreturn,
                                    lock_function=calls.lock_wait,
                                    busy=calls.busy_stops,
                                    main_only=time.monotonic() < main_until)
        # mmap: a main thread in a lock wait is left in it for the pending call, unless
        # it is the only thread there is to borrow
        return any(_borrow_a_thread(ptrace, pid, function, args, calls.sigreturn,
                                    lock_function=lock_function,
                                    busy=calls.busy_stops)
                   for lock_function in (None, calls.lock_wait))

    def borrow(function: int, args: tuple[int, ...], *, pending: bool = False) -> None:
        tries = 0
        main_until = time.monotonic() + _PREFER_MAIN_SECONDS
        while not borrow_once(function, args, pending=pending, main_until=main_until):
            tries += 1
            progress.waiting_for(pid, "a thread of the job that waits in the kernel, or a "
                                 "busy main thread in the eval loop or outside Python and "
                                 "libc, to queue the probe", tries=tries)
            if not same_process(pid, start_time):
                raise exited_during_injection(pid)
            if time.monotonic() >= deadline:
                raise no_safe_point(pid, wait_seconds)
            # A random pause: a loop whose period matches a fixed one would be met at
            # the same unsafe PC every time.
            time.sleep(POLL_SECONDS * random.uniform(1.0, 4.0))

    page = free_address(memory_map(pid), size)
    if page is None:
        raise InjectionFailed(f"found no free address range in process {pid}",
                              "start the job with `dlprof-agent run -- python ...` instead",
                              pid=pid)
    borrow(calls.mmap, (page, size, mmap.PROT_READ | mmap.PROT_WRITE,
                        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED_NOREPLACE, -1, 0))
    chain_deadline = time.monotonic() + _CHAIN_SECONDS
    while not any(start == page for start, *_ in memory_map(pid)):
        if not same_process(pid, start_time):
            raise exited_during_injection(pid)
        if time.monotonic() >= chain_deadline:
            raise InjectionNotNow(f"process {pid} did not map a page for the probe's bootstrap",
                                  "the agent tries again on its next passes", pid=pid)
        time.sleep(POLL_SECONDS)
    _write_memory(pid, page, payload.replace(ADDRESS_PLACEHOLDER.encode(),
                                             f"{page:#018x}".encode(), 1))
    borrow(calls.add_pending_call, (calls.run_simple_string, page + FLAG_BYTES), pending=True)
    return remember(QueuedBootstrap(pid, start_time or 0, page, time.monotonic()))
