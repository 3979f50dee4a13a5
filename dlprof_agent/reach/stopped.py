"""A thread the ptrace injector stopped, as its CPU's place (``cpu``) reads it."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

Read = Callable[[int, int], bytes]


class Stopped(NamedTuple):
    """A thread stopped by the injector, as its CPU's place reads it."""

    registers: list[int]  # as ptrace gives them (NT_PRSTATUS)
    pc: int
    sp: int
    call: int  # the system call it waits in; -1 where it is in none (busy)
    arguments: tuple[int, ...]  # that call's six arguments
    # The kernel would resume the call through restart_syscall: rt_sigreturn would
    # turn that into EINTR (x86-64), or restart its whole timeout
    restart_block: bool = False
    # A wait the stop interrupted, to be resumed (x86-64: ERESTARTSYS or
    # ERESTART_RESTARTBLOCK in rax; arm64: rewound to its svc), as lock_wait needs it
    interrupted: bool = False
