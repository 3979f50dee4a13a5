"""What the ptrace injector (``ptrace``) needs of the CPU it runs on, one place per
architecture: ``x86_64`` and ``arm64``. The plan (``call_plan``) and the borrowing
(``ptrace``, ``tracer``) are shared; each place says how a stopped thread's registers
read, which waits it may be borrowed from, where a call returns from (the code of an
``rt_sigreturn``), and the signal frame that puts the thread back whole."""

from __future__ import annotations

from typing import Protocol

from dlprof_agent.collectors.target import Target
from dlprof_agent.reach.stopped import Read, Stopped
from dlprof_agent.reach.tracer import Tracer


class Cpu(Protocol):
    name: str
    futex: int  # the system call numbers lock_wait and threads look for
    restart_syscall: int
    sigreturn_code: tuple[bytes, ...]  # an rt_sigreturn, as its C library or vDSO has it

    def borrowable(self, number: int, arguments: tuple[int, ...] | list[int]) -> bool: ...

    def registers(self, ptrace: Tracer, tid: int) -> list[int]: ...

    def set_registers(self, ptrace: Tracer, tid: int, registers: list[int]) -> None:
        """All of them at once."""
        ...

    def stopped(self, registers: list[int], read: Read) -> Stopped: ...

    def after_a_call(self, read: Read, address: int) -> bool: ...

    def code_address(self, word: int) -> int:
        """A return address as stored on the stack, without any authentication code."""
        ...

    def calls(self, read: Read, address: int, function: int) -> bool:
        """``address`` follows a direct call of ``function``."""
        ...

    def caller_index(self, words: list[int], top: int, index: int, read: Read, callee: int
                     ) -> int | None:
        """Of the stack's ``words`` from ``top`` up, ``words[index]`` returning into the
        function at ``callee``: the index of that function's own return address."""
        ...

    def names_address(self, code: bytes, code_address: int, target: int) -> bool:
        """``code``, loaded at ``code_address``, puts the address ``target`` in a
        register (``pending_mutex``)."""
        ...

    def thread_state(self, ptrace: Tracer, target: Target, tid: int) -> object:
        """What the frame must hold beyond the general registers; raises
        InjectionUnsafe where it cannot hold it."""
        ...

    def frame_at(self, sp: int, state: object) -> int:
        """Where the frame goes below a stack pointer of ``sp``."""
        ...

    def frame_limit(self, sp: int) -> int:
        """The frame must end at or below this, for a stack pointer of ``sp``."""
        ...

    def frame(self, at: int, stopped: Stopped, state: object, blocked: int, gadget: int, *,
              interrupt: bool) -> bytes:
        """The frame at ``at``; raises StateNotKept (``frame`` or ``arm64``)."""
        ...

    def call_registers(self, stopped: Stopped, at: int, function: int,
                       arguments: tuple[int, ...], gadget: int) -> list[int]: ...

    def sigreturn_sp(self, at: int) -> int:
        """The stack pointer at the detour's rt_sigreturn."""
        ...

    def in_sigreturn(self, registers: list[int], sigreturn_sp: int) -> bool: ...

    def put_back(self, ptrace: Tracer, target: Target, tid: int, state: object) -> None:
        """With the thread back from its detour: any state not restored, put back."""
        ...
