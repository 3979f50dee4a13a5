"""The ptrace(2) requests the agent's injector makes, through libc, and the stops
around a borrowed thread's call: taking the job's other threads while a busy 3.13 main
thread queues its pending call (``hold_other_threads``, ``until_it_returns``), and
letting each go (``release``). A tracer that dies lets every thread it holds go on:
the kernel detaches them."""

from __future__ import annotations

import contextlib
import os
import signal
import time

from dlprof_agent.collectors.procfs import list_tasks
from dlprof_agent.errors import TargetGone
from dlprof_agent.reach.frame import MAX_XSTATE_BYTES, NT_X86_XSTATE, REGISTERS

PTRACE_GETREGS, PTRACE_SETREGS, PTRACE_GETFPREGS, PTRACE_DETACH = 12, 13, 14, 17
PTRACE_GETREGSET, PTRACE_SEIZE, PTRACE_INTERRUPT = 0x4204, 0x4206, 0x4207
PTRACE_EVENT_STOP = 128
PTRACE_SYSCALL, PTRACE_SETOPTIONS, PTRACE_O_TRACESYSGOOD = 24, 0x4200, 1
WALL = 0x40000000
RT_SIGRETURN = 15
# How long other threads stay stopped while a busy 3.13 main thread queues its call
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

    def xstate(self, tid: int) -> bytes | None:
        """The thread's XSAVE image (PTRACE_GETREGSET), or None where the kernel has
        none to give."""
        area = (self._ctypes.c_ubyte * MAX_XSTATE_BYTES)()
        vector = (self._ctypes.c_void_p * 2)(self._ctypes.addressof(area), MAX_XSTATE_BYTES)
        try:
            self(PTRACE_GETREGSET, tid, self._ctypes.addressof(vector), NT_X86_XSTATE)
        except OSError:
            return None
        return bytes(area)[:vector[1] or 0]

    def fxsave(self, tid: int) -> bytes:
        area = (self._ctypes.c_ubyte * 512)()
        self(PTRACE_GETFPREGS, tid, self._ctypes.addressof(area))
        return bytes(area)


def hold_other_threads(ptrace: Tracer, pid: int, held: dict[int, int]) -> bool:
    """Stop every thread of ``pid`` but the main one, recording each in ``held`` (with
    a signal that arrived meanwhile, to pass on). True when all are stopped and no
    thread appeared meanwhile."""
    try:
        others = [tid for tid in list_tasks(pid) if tid != pid]
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
        return sorted(tid for tid in list_tasks(pid) if tid != pid) == sorted(others)
    except TargetGone:
        return False


def until_it_returns(ptrace: Tracer, tid: int) -> int:
    """Let the borrowed thread run its call, with the others held, up to its
    rt_sigreturn (the detour's end) or for at most HOLD_SECONDS; it is left stopped at
    a system call or a signal. The signal to pass on when it is let go, if any."""
    ptrace(PTRACE_SETOPTIONS, tid, PTRACE_O_TRACESYSGOOD)
    deadline = time.monotonic() + HOLD_SECONDS
    deliver = 0
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
            return 0
        if stop != signal.SIGTRAP | 0x80:  # a signal for it
            if time.monotonic() >= deadline:
                return stop
            deliver = stop  # delivered as it goes on
        elif dict(zip(REGISTERS, ptrace.registers(tid), strict=True))["orig_rax"] == \
                RT_SIGRETURN or time.monotonic() >= deadline:
            return 0


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

