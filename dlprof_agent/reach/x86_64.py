"""The ptrace injector's place for x86-64 (``cpu``): registers as PTRACE_GETREGS gives
them, the waits of ``threads``, and the signal frame of ``frame``, which holds the
thread's XSAVE state cut to its own layout (``register_state``)."""

from __future__ import annotations

from typing import NamedTuple

from dlprof_agent.collectors.target import Target
from dlprof_agent.reach import lock_wait, threads
from dlprof_agent.reach.frame import REGISTERS, frame_state_bytes, signal_frame, signed
from dlprof_agent.reach.pending_mutex import code_names_address
from dlprof_agent.reach.register_state import cpu_layout, put_back
from dlprof_agent.reach.stopped import Read, Stopped
from dlprof_agent.reach.tracer import Tracer
from dlprof_agent.reach.xsave_layout import XsaveLayout

# mov $15,%rax; syscall (and the %eax form): rt_sigreturn, as libc's signal restorer does it
SIGRETURN_CODE = (b"\x48\xc7\xc0\x0f\x00\x00\x00\x0f\x05", b"\xb8\x0f\x00\x00\x00\x0f\x05")
RT_SIGRETURN = 15
_SYSCALL_ARGUMENTS = ("rdi", "rsi", "rdx", "r10", "r8", "r9")
_CALL_ARGUMENTS = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")
_ERESTART_RESTARTBLOCK = -516
# How the kernel leaves a wait that a ptrace stop interrupted: ERESTARTSYS (no timeout,
# or an absolute one), ERESTART_RESTARTBLOCK (a timeout it resumes)
_INTERRUPTED = (-512, _ERESTART_RESTARTBLOCK)
_RED_ZONE = 128
_FRAME_GAP = 2048  # below the red zone: where the borrowed thread's detour frame goes
_DIRECTION_FLAG = 0x400


class State(NamedTuple):
    """A thread's FPU state as ptrace gives it, and this CPU's XSAVE layout."""

    xstate: bytes | None
    fxsave: bytes
    layout: XsaveLayout


class X86_64:
    name = "x86-64"
    futex = lock_wait.FUTEX
    restart_syscall = lock_wait.RESTART_SYSCALL
    sigreturn_code: tuple[bytes, ...] = SIGRETURN_CODE

    def borrowable(self, number: int, arguments: tuple[int, ...] | list[int]) -> bool:
        return threads.borrowable(number, list(arguments))

    def registers(self, ptrace: Tracer, tid: int) -> list[int]:
        return ptrace.registers(tid)

    def set_registers(self, ptrace: Tracer, tid: int, registers: list[int]) -> None:
        ptrace.set_registers(tid, registers)

    def stopped(self, registers: list[int], read: Read) -> Stopped:
        r = dict(zip(REGISTERS, registers, strict=True))
        rax = signed(r["rax"])
        return Stopped(registers, r["rip"], r["rsp"], signed(r["orig_rax"]),
                       tuple(r[name] for name in _SYSCALL_ARGUMENTS),
                       restart_block=rax == _ERESTART_RESTARTBLOCK,
                       interrupted=rax in _INTERRUPTED)

    def after_a_call(self, read: Read, address: int) -> bool:
        return lock_wait.after_a_call(read, address)

    def code_address(self, word: int) -> int:
        return word

    def calls(self, read: Read, address: int, function: int) -> bool:
        return lock_wait.calls(read, address, function)

    def caller_index(self, words: list[int], top: int, index: int, read: Read, callee: int
                     ) -> int | None:
        return lock_wait.caller_index(words, index, read, callee)

    def names_address(self, code: bytes, code_address: int, target: int) -> bool:
        return code_names_address(code, code_address, target)

    def thread_state(self, ptrace: Tracer, target: Target, tid: int) -> State:
        layout = cpu_layout(target)
        return State(ptrace.xstate(tid), ptrace.fxsave(tid), layout)

    def frame_at(self, sp: int, state: object) -> int:
        assert isinstance(state, State)
        gap = max(_FRAME_GAP, 8 + 304 + 64 + frame_state_bytes(state.xstate) + 64)
        return ((sp - _RED_ZONE - gap) & ~15) - 8  # a call's entry: rsp % 16 == 8

    def frame_limit(self, sp: int) -> int:
        return sp - _RED_ZONE

    def frame(self, at: int, stopped: Stopped, state: object, blocked: int, gadget: int, *,
              interrupt: bool) -> bytes:
        assert isinstance(state, State)
        return signal_frame(at, stopped.registers, state.fxsave, blocked, gadget,
                            interrupt=interrupt, xstate=state.xstate, layout=state.layout)

    def call_registers(self, stopped: Stopped, at: int, function: int,
                       arguments: tuple[int, ...], gadget: int) -> list[int]:
        r = dict(zip(REGISTERS, stopped.registers, strict=True))
        # The direction flag cleared, as a call requires and the kernel does for a
        # handler: a busy thread may be stopped inside a backward string copy.
        new = dict(r, rsp=at, rip=function, rax=0, orig_rax=(1 << 64) - 1,
                   eflags=r["eflags"] & ~_DIRECTION_FLAG)
        for register, value in zip(_CALL_ARGUMENTS, arguments, strict=False):
            new[register] = value % (1 << 64)
        return [new[name] for name in REGISTERS]

    def sigreturn_sp(self, at: int) -> int:
        return at + 8  # rt_sigreturn runs with the gadget's address popped

    def in_sigreturn(self, registers: list[int], sigreturn_sp: int) -> bool:
        r = dict(zip(REGISTERS, registers, strict=True))
        return r["orig_rax"] == RT_SIGRETURN and r["rsp"] == sigreturn_sp

    def put_back(self, ptrace: Tracer, target: Target, tid: int, state: object) -> None:
        assert isinstance(state, State)
        put_back(ptrace, target, tid, state.xstate, state.layout)
