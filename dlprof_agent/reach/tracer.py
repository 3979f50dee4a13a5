"""The ptrace(2) requests the agent's injector makes, through libc, and the stops
around a borrowed thread's call: following it to the end of its ``rt_sigreturn``
(``until_it_returns``), where its restored state is checked; taking the job's other
threads while a busy 3.13 main thread queues its pending call (``hold_other_threads``);
and letting each go (``release``). A tracer that dies lets every thread it holds go on:
the kernel detaches them."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable

from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import TargetGone
from dlprof_agent.reach.frame import MAX_XSTATE_BYTES, NT_X86_XSTATE, REGISTERS
from dlprof_agent.reach.procfs import list_tasks

PTRACE_GETREGS, PTRACE_SETREGS, PTRACE_GETFPREGS, PTRACE_DETACH = 12, 13, 14, 17
PTRACE_GETREGSET, PTRACE_SETREGSET = 0x4204, 0x4205
PTRACE_SEIZE, PTRACE_INTERRUPT = 0x4206, 0x4207
PTRACE_EVENT_STOP = 128
PTRACE_SYSCALL, PTRACE_SETOPTIONS, PTRACE_O_TRACESYSGOOD = 24, 0x4200, 1
WALL = 0x40000000
# How long a borrowed thread is followed to its rt_sigreturn, and other threads stay
# stopped while a busy 3.13 main thread queues its call
HOLD_SECONDS = 0.5


class Tracer:
    """ptrace(2) for one agent: each request raises OSError when the kernel refuses it."""

    def __init__(self) -> None:
        import ctypes

        self._ctypes = ctypes
        call = ctypes.CDLL(None, use_errno=True).ptrace
        call.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        call.restype = ctypes.c_long
        self._call = call

    def __call__(self, request: int, tid: int, data: object = None, address: int = 0
                 ) -> None:
        self._ctypes.set_errno(0)
        if self._call(request, tid, address or None, data) == -1:
            error = self._ctypes.get_errno()
            raise OSError(error, os.strerror(error))

    def registers(self, tid: int) -> list[int]:
        regs = (self._ctypes.c_ulonglong * len(REGISTERS))()
        self(PTRACE_GETREGS, tid, self._ctypes.addressof(regs))
        return list(regs)

    def set_registers(self, tid: int, values: list[int]) -> None:
        regs = (self._ctypes.c_ulonglong * len(REGISTERS))(*values)
        self(PTRACE_SETREGS, tid, self._ctypes.addressof(regs))  # all of them, at once

    def regset(self, tid: int, note: int, size: int) -> bytes | None:
        """Register set ``note`` of the thread (PTRACE_GETREGSET, at most ``size``
        bytes, as many as the kernel gives), or None where it has none to give."""
        area = (self._ctypes.c_ubyte * size)()
        vector = (self._ctypes.c_void_p * 2)(self._ctypes.addressof(area), size)
        try:
            self(PTRACE_GETREGSET, tid, self._ctypes.addressof(vector), note)
        except OSError:
            return None
        return bytes(area)[:vector[1] or 0]

    def set_regset(self, tid: int, note: int, data: bytes) -> None:
        area = (self._ctypes.c_ubyte * len(data)).from_buffer_copy(data)
        vector = (self._ctypes.c_void_p * 2)(self._ctypes.addressof(area), len(data))
        self(PTRACE_SETREGSET, tid, self._ctypes.addressof(vector), note)

    def xstate(self, tid: int) -> bytes | None:
        """The thread's XSAVE image, or None where the kernel has none to give."""
        return self.regset(tid, NT_X86_XSTATE, MAX_XSTATE_BYTES)

    def set_xstate(self, tid: int, image: bytes) -> None:
        """Put back an image ``xstate`` gave (the kernel takes only its whole size)."""
        self.set_regset(tid, NT_X86_XSTATE, image)

    def fxsave(self, tid: int) -> bytes:
        area = (self._ctypes.c_ubyte * 512)()
        self(PTRACE_GETFPREGS, tid, self._ctypes.addressof(area))
        return bytes(area)


def hold_other_threads(ptrace: Tracer, target: Target, held: dict[int, int]) -> bool:
    """Stop every thread of the target but the main one, recording each in ``held`` (with
    a signal that arrived meanwhile, to pass on). True when all are stopped and no
    thread appeared meanwhile."""
    pid, procfs = target.pid, target.procfs
    try:
        others = [tid for tid in list_tasks(pid, procfs=procfs) if tid != pid]
    except TargetGone:
        return False
    for tid in others:
        try:
            ptrace(PTRACE_SEIZE, tid)
        except OSError:
            return False
        held[tid] = 0
        try:
            ptrace(PTRACE_INTERRUPT, tid)
            _, status = os.waitpid(tid, WALL)
        except (OSError, ChildProcessError):
            return False
        if not os.WIFSTOPPED(status):
            del held[tid]
            return False
        if status >> 16 != PTRACE_EVENT_STOP:
            held[tid] = os.WSTOPSIG(status)
    try:
        return sorted(tid for tid in list_tasks(pid, procfs=procfs)
                      if tid != pid) == sorted(others)
    except TargetGone:
        return False


def until_it_returns(ptrace: Tracer, tid: int, in_its_sigreturn: Callable[[list[int]], bool],
                     registers: Callable[[int], list[int]]) -> tuple[int, bool]:
    """Let the borrowed thread run its call up to the end of its rt_sigreturn (the
    detour's end, which ``in_its_sigreturn`` tells by the thread's registers at a
    system-call stop: not a signal handler's), for at most HOLD_SECONDS; it is left
    stopped there, or at a system call or a signal. The signal to pass on when it is
    let go, if any, and whether it stopped at the end of that rt_sigreturn, with the
    state of the frame restored."""
    ptrace(PTRACE_SETOPTIONS, tid, PTRACE_O_TRACESYSGOOD)
    deadline = time.monotonic() + HOLD_SECONDS
    deliver = 0
    in_sigreturn = False  # its entry stop seen: the next system-call stop is its exit
    while True:
        ptrace(PTRACE_SYSCALL, tid, deliver)
        deliver = 0
        while True:
            waited, status = os.waitpid(tid, WALL | os.WNOHANG)
            if waited:
                break
            if time.monotonic() >= deadline:
                ptrace(PTRACE_INTERRUPT, tid)
                _, status = os.waitpid(tid, WALL)
                break
            time.sleep(0.0005)
        if not os.WIFSTOPPED(status):
            raise ChildProcessError(f"thread {tid} ended")
        stop = os.WSTOPSIG(status)
        if status >> 16:  # stopped by our interrupt or a group stop: let it go as it is
            return 0, False
        if stop != signal.SIGTRAP | 0x80:  # a signal for it
            if time.monotonic() >= deadline:
                return stop, False
            deliver = stop  # delivered as it goes on
            continue
        if in_sigreturn:
            return 0, True
        in_sigreturn = in_its_sigreturn(registers(tid))
        if time.monotonic() >= deadline:
            return 0, False


def release(ptrace: Tracer, tid: int, stopped: bool, signal_to_pass: int) -> None:
    # Detaching needs a stopped tracee; one left seized would stop at its next signal.
    with contextlib.suppress(OSError, ChildProcessError):
        if not stopped:
            ptrace(PTRACE_INTERRUPT, tid)
            _, status = os.waitpid(tid, WALL)
            if not os.WIFSTOPPED(status):
                return
            if status >> 16 != PTRACE_EVENT_STOP:
                signal_to_pass = os.WSTOPSIG(status)
        ptrace(PTRACE_DETACH, tid, signal_to_pass)

