"""Which of the ptrace injector's places (``cpu``) this machine's CPU has."""

from __future__ import annotations

import platform

from dlprof_agent.reach.arm64 import Arm64
from dlprof_agent.reach.cpu import Cpu
from dlprof_agent.reach.x86_64 import X86_64


def this_cpu() -> Cpu | None:
    """This machine's place; None where the injector has none (then gdb is used)."""
    machine = platform.machine()
    if machine == "x86_64":
        return X86_64()
    if machine in ("aarch64", "arm64"):
        return Arm64()
    return None
