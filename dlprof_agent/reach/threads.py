"""The threads of a process the injectors may act through: those that wait in the
kernel (``/proc/<pid>/task/*/syscall``). A thread there is between two pieces of C
code, so it cannot be inside the pending-call lock's critical section, which has no
system call in it. Also what the injectors say when none waits, or when the process
went away under them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import InjectionNotNow, TargetGone, TargetNotFound
from dlprof_agent.reach.procfs import list_tasks, read_task_syscall, status_of, thread_state
from dlprof_agent.reach.refusal import refused

if TYPE_CHECKING:
    from dlprof_agent.reach.cpu import Cpu

POLL_SECONDS = 0.005  # between looks at the threads' states
# System calls a waiting thread may be borrowed from, by x86-64's numbers (arm64's
# rules are in ``arm64``): none of them changes the signal mask
# for its duration (ppoll, pselect, epoll_pwait and sigsuspend do), and the kernel restarts
# or fails each of them the same way after our detour as after any ptrace stop.
BORROWABLE = frozenset({0, 7, 23, 35, 43, 45, 47, 61, 202, 230, 232, 247, 288})
# These change it only when given a mask: pselect6, ppoll, epoll_pwait, epoll_pwait2, and
# the index of that argument (Python's time.sleep is pselect6 with none, on some builds).
MASK_ARGUMENT = {270: 5, 271: 3, 281: 4, 441: 4}


def thread_syscalls(target: Target) -> list[tuple[int, list[str]]]:
    """Each thread of the target, main thread first, with the fields of its
    /proc/<pid>/task/<tid>/syscall: the number and arguments of the system call it
    waits in, or "running" or -1 when it waits in none. Threads that end meanwhile are
    left out. Raises InjectionRefused when the agent may not read them."""
    pid, procfs = target.pid, target.procfs
    try:
        tids = list_tasks(pid, procfs=procfs)
    except (TargetGone, ValueError):
        return []
    found = []
    for tid in tids:
        try:
            fields = read_task_syscall(pid, tid, procfs=procfs)
        except TargetGone:
            continue
        if fields is None:
            raise refused(target, "cannot read the state of its threads")
        found.append((tid, fields))
    return found


def borrowable(number: int, arguments: list[int]) -> bool:
    """A thread waiting in system call ``number`` with ``arguments`` may be borrowed."""
    if number in BORROWABLE:
        return True
    index = MASK_ARGUMENT.get(number)
    return index is not None and index < len(arguments) and arguments[index] == 0


def blocked_signals(target: Target, tid: int) -> int | None:
    status = status_of(target.pid, tid=tid, procfs=target.procfs)
    return None if status is None else status.sig_blk


def waiting_threads(target: Target, cpu: Cpu) -> list[int]:
    """Threads of the target waiting in a system call we may borrow them from (by the
    numbers and rules of ``cpu``), main first; and those in restart_syscall (a timed
    wait resumed after a stop), which only a CPython lock wait of the main thread is
    borrowed from (``lock_wait``)."""
    found = []
    for tid, fields in thread_syscalls(target):
        try:
            number, arguments = int(fields[0]), [int(field, 16) for field in fields[1:7]]
        except (IndexError, ValueError):
            continue  # "running", or -1: not in a system call
        # Interruptible sleep only: a thread in uninterruptible sleep (D, disk or NFS I/O)
        # would keep the agent waiting for its stop.
        if (cpu.borrowable(number, arguments) or number == cpu.restart_syscall) and thread_state(
                target.pid, tid, procfs=target.procfs) == "S":
            found.append(tid)
    return found


def in_kernel(fields: list[str]) -> bool:
    """A thread's syscall fields say it waits in a system call."""
    return bool(fields) and fields[0] not in ("running", "-1")


def exited_during_injection(target: Target) -> TargetNotFound:
    return TargetNotFound(f"process {target.pid} exited during the injection",
                          "attach to a running job", pid=target.pid)


def no_safe_point(target: Target, seconds: float) -> InjectionNotNow:
    return InjectionNotNow(
        f"process {target.pid} reached no safe point to queue the probe within {seconds:g} s "
        "(none of its threads waited in the kernel, and its main thread was never met "
        "in the eval loop's own code nor outside Python and libc); "
        "nothing was done to it",
        "the agent tries again on its next passes; or start the job with "
        "`dlprof-agent run -- python ...`", pid=target.pid)
