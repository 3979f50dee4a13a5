"""The agent's own injector on x86-64 and arm64: it borrows one thread of the job that
waits in the kernel, has it call a function, and the thread puts itself back. What
differs between the two CPUs (registers, the waits, the frame) is each one's place
(``cpu``: ``x86_64``, ``arm64``); what follows is said for x86-64, and ``arm64`` says
how its frame holds the FP/SIMD and SVE registers instead.

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
cannot hold the whole state, nothing is borrowed (``InjectionUnsafe``). Nor is one
borrowed while the job's interpreter shuts down (``shutdown``): its call would find none.

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
import platform
import random
import signal
import time
from collections.abc import Callable
from typing import NamedTuple

from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import InjectionFailed, InjectionNotNow, StateNotKept
from dlprof_agent.reach.call_plan import CallAddresses
from dlprof_agent.reach.cpu import Cpu
from dlprof_agent.reach.cpus import this_cpu
from dlprof_agent.reach.lock_wait import LockWait, in_lock_wait
from dlprof_agent.reach.mapped_files import free_address, read_memory
from dlprof_agent.reach.pending import (
    ADDRESS_PLACEHOLDER,
    FLAG_BYTES,
    QueuedBootstrap,
    pending_payload,
    remember,
)
from dlprof_agent.reach.procfs import Mapping, memory_map, open_memory
from dlprof_agent.reach.refusal import refused
from dlprof_agent.reach.register_state import unsafe
from dlprof_agent.reach.safe_point import BusyStops, in_signal_handler
from dlprof_agent.reach.shutdown import LifeWords, exiting, shutting_down
from dlprof_agent.reach.threads import (
    POLL_SECONDS,
    blocked_signals,
    exited_during_injection,
    no_safe_point,
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
# A call the kernel resumes through restart_syscall (a relative sleep, a futex or poll
# with a timeout) is never borrowed: rt_sigreturn turns that resumption into EINTR.
_STACK_NEEDED = 64 << 10  # free stack the called function may use below the frame
_CHAIN_SECONDS = 5.0  # for a borrowed thread to be scheduled and finish its detour
# How long the pending call waits for the main thread itself: CPython runs pending calls
# only there, and from another thread 3.10-3.12 tell it only when it next takes the GIL,
# which a main thread in a lock wait may not do for hours.
_PREFER_MAIN_SECONDS = 0.5

# What the injector waits for, in a few words, and how many tries it has made: said to
# whoever shows the agent's progress.
SayWaiting = Callable[[str, int], None]


def say_nothing(what: str, tries: int) -> None:
    pass


def _write_memory(target: Target, address: int, data: bytes) -> None:
    with open_memory(target.pid, writable=True, procfs=target.procfs) as memory:
        memory.seek(address)
        if memory.write(data) != len(data):
            raise OSError(f"short write to process {target.pid}")


def _maps(target: Target) -> list[Mapping]:
    return memory_map(target.pid, procfs=target.procfs)


class Detour(NamedTuple):
    """A borrowed thread on its way: where its rt_sigreturn finds the frame, and the
    state that frame holds, to check once the thread is back."""

    sigreturn_sp: int
    state: object


def _detour(ptrace: Tracer, target: Target, tid: int,
            call: tuple[int, tuple[int, ...], int], maps: list[Mapping], *, cpu: Cpu,
            lock_function: LockWait | None = None, busy: BusyStops | None = None,
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

    def read(address: int, size: int) -> bytes:
        return read_memory(target, address, size)

    stopped = cpu.stopped(cpu.registers(ptrace, tid), read)
    stack = next(((start, end) for start, end, *_ in maps if start <= stopped.sp < end), None)
    interrupt = (tid == target.pid and lock_function is not None and stack is not None
                 and in_lock_wait(cpu, stopped, read, stack[1], lock_function))
    if stopped.call < 0:
        if busy is None or stack is None or not busy.accepts(stopped.pc, maps) or (
                in_signal_handler(read, stopped.sp, stack[1], gadget, cpu.code_address)) or (
                hold_others is not None and not hold_others()):
            return None
    elif not interrupt and (not cpu.borrowable(stopped.call, stopped.arguments)
                            or stopped.restart_block):
        return None
    try:
        state = cpu.thread_state(ptrace, target, tid)
        blocked = blocked_signals(target, tid)
        at = cpu.frame_at(stopped.sp, state)
        if blocked is None or stack is None or at - _STACK_NEEDED < stack[0]:
            return None
        frame = cpu.frame(at, stopped, state, blocked, gadget, interrupt=interrupt)
    except StateNotKept as error:
        raise unsafe(target, f"thread {tid}: {error}") from None
    if at + len(frame) > cpu.frame_limit(stopped.sp):
        return None
    _write_memory(target, at, frame)
    cpu.set_registers(ptrace, tid, cpu.call_registers(stopped, at, function, args, gadget))
    return Detour(cpu.sigreturn_sp(at), state)


def _borrow_a_thread(ptrace: Tracer, target: Target, function: int, args: tuple[int, ...],
                     gadget: int, *, cpu: Cpu, lock_function: LockWait | None = None,
                     busy: BusyStops | None = None, main_only: bool = False,
                     life: LifeWords | None = None) -> bool:
    """Have one waiting thread of the target call ``function(*args)`` and go back to its wait.
    Only that thread stops, for microseconds at a time; it needs nothing more from us
    once it is set on its way, so the agent may die at any moment. False when none could be had.
    Where none waits (or with ``main_only``, where the main thread does not), the main
    thread is taken busy, at a safe PC, given ``busy``: it runs the pending call itself.
    Raises InjectionNotNow where ``life`` says the interpreter is shutting down."""
    pid = target.pid
    maps = _maps(target)
    waiting = waiting_threads(target, cpu)
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
                raise refused(target, "ptrace was denied") from None
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
            if life is not None and shutting_down(life, functools.partial(read_memory, target)):
                raise exiting(target)
            hold = None if mutex is None else functools.partial(
                _hold_with_the_mutex_free, ptrace, target, held, mutex)
            detour = _detour(ptrace, target, tid, (function, args, gadget), maps, cpu=cpu,
                             lock_function=lock_function, busy=busy, hold_others=hold)
            if detour is not None:
                # Its call is set: whatever happens now, it is done, and its frame
                # restores it. While the agent lives, it follows the thread to its
                # frame's rt_sigreturn and checks what came back.
                with contextlib.suppress(OSError, ChildProcessError):
                    signal_to_pass, returned = until_it_returns(
                        ptrace, tid, functools.partial(cpu.in_sigreturn,
                                                       sigreturn_sp=detour.sigreturn_sp),
                        functools.partial(cpu.registers, ptrace))
                    if returned:
                        cpu.put_back(ptrace, target, tid, detour.state)
                return True
        except OSError:
            continue
        finally:
            release(ptrace, tid, stopped, signal_to_pass)
            for other, its_signal in held.items():
                release(ptrace, other, True, its_signal)
    return False


def _hold_with_the_mutex_free(ptrace: Tracer, target: Target, held: dict[int, int],
                              mutex: int) -> bool:
    """Every other thread of the target held, and 3.13's pending-call PyMutex at ``mutex``
    free: its byte 0, unlocked with no waiter parked."""
    try:
        return (hold_other_threads(ptrace, target, held)
                and read_memory(target, mutex, 1) == b"\0")
    except OSError:
        return False


def inject_with_ptrace(target: Target, code: str, calls: CallAddresses, wait_seconds: float,
                       *, say_waiting: SayWaiting = say_nothing) -> QueuedBootstrap:
    """Queue ``code`` as a pending call in the target: a borrowed thread maps a page, the
    agent writes the code there, and a borrowed thread queues it."""
    pid = target.pid
    payload = pending_payload(code)
    size = -(-len(payload) // mmap.PAGESIZE) * mmap.PAGESIZE
    ptrace = Tracer()
    cpu = this_cpu()
    if cpu is None:
        raise InjectionFailed(f"the agent's injector has no place for {platform.machine()}",
                              "start the job with `dlprof-agent run -- python ...`", pid=pid)
    deadline = time.monotonic() + wait_seconds

    def borrow_once(function: int, args: tuple[int, ...], *, pending: bool,
                    main_until: float) -> bool:
        if pending:  # the main thread, for a while: from another the call may wait long
            return _borrow_a_thread(ptrace, target, function, args, calls.sigreturn, cpu=cpu,
                                    lock_function=calls.lock_wait, busy=calls.busy_stops,
                                    main_only=time.monotonic() < main_until, life=calls.life)
        # mmap: a main thread in a lock wait is left in it for the pending call, unless
        # it is the only thread there is to borrow
        return any(_borrow_a_thread(ptrace, target, function, args, calls.sigreturn, cpu=cpu,
                                    lock_function=lock_function, busy=calls.busy_stops,
                                    life=calls.life)
                   for lock_function in (None, calls.lock_wait))

    def borrow(function: int, args: tuple[int, ...], *, pending: bool = False) -> None:
        tries = 0
        main_until = time.monotonic() + _PREFER_MAIN_SECONDS
        while not borrow_once(function, args, pending=pending, main_until=main_until):
            tries += 1
            say_waiting("a thread of the job that waits in the kernel, or a busy main thread "
                        "in the eval loop or outside Python and libc, to queue the probe", tries)
            if not target.is_running():
                raise exited_during_injection(target)
            if time.monotonic() >= deadline:
                raise no_safe_point(target, wait_seconds)
            # A random pause: a loop whose period matches a fixed one would be met at
            # the same unsafe PC every time.
            time.sleep(POLL_SECONDS * random.uniform(1.0, 4.0))

    page = free_address(_maps(target), size)
    if page is None:
        raise InjectionFailed(f"found no free address range in process {pid}",
                              "start the job with `dlprof-agent run -- python ...` instead",
                              pid=pid)
    borrow(calls.mmap, (page, size, mmap.PROT_READ | mmap.PROT_WRITE,
                        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED_NOREPLACE, -1, 0))
    chain_deadline = time.monotonic() + _CHAIN_SECONDS
    while not any(start == page for start, *_ in _maps(target)):
        if not target.is_running():
            raise exited_during_injection(target)
        if time.monotonic() >= chain_deadline:
            raise InjectionNotNow(f"process {pid} did not map a page for the probe's bootstrap",
                                  "the agent tries again on its next passes", pid=pid)
        time.sleep(POLL_SECONDS)
    _write_memory(target, page, payload.replace(ADDRESS_PLACEHOLDER.encode(),
                                             f"{page:#018x}".encode(), 1))
    borrow(calls.add_pending_call, (calls.run_simple_string, page + FLAG_BYTES), pending=True)
    return remember(QueuedBootstrap(target, page, time.monotonic()))
