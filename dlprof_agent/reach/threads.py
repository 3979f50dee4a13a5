"""The threads of a process the injectors may act through: those that wait in the
kernel (``/proc/<pid>/task/*/syscall``). A thread there is between two pieces of C
code, so it cannot be inside the pending-call lock's critical section, which has no
system call in it. Also what the injectors say when none waits, or when the process
went away under them."""

from __future__ import annotations

from dlprof_agent.collectors.procfs import PROC_ROOT, list_tasks, read_task_syscall
from dlprof_agent.errors import InjectionNotNow, TargetGone, TargetNotFound
from dlprof_agent.reach.procfs import running, start_ticks, status_of, thread_state
from dlprof_agent.reach.refusal import refused

POLL_SECONDS = 0.005  # between looks at the threads' states
# System calls a waiting thread may be borrowed from: none of them changes the signal mask
# for its duration (ppoll, pselect, epoll_pwait and sigsuspend do), and the kernel restarts
# or fails each of them the same way after our detour as after any ptrace stop.
BORROWABLE = frozenset({0, 7, 23, 35, 43, 45, 47, 61, 202, 230, 232, 247, 288})
# These change it only when given a mask: pselect6, ppoll, epoll_pwait, epoll_pwait2, and
# the index of that argument (Python's time.sleep is pselect6 with none, on some builds).
MASK_ARGUMENT = {270: 5, 271: 3, 281: 4, 441: 4}
RESTART_SYSCALL = 219


def thread_syscalls(pid: int) -> list[tuple[int, list[str]]]:
    """Each thread of ``pid``, main thread first, with the fields of its
    /proc/<pid>/task/<tid>/syscall: the number and arguments of the system call it
    waits in, or "running" or -1 when it waits in none. Threads that end meanwhile are
    left out. Raises InjectionRefused when the agent may not read them."""
    try:
        tids = list_tasks(pid)
    except (TargetGone, ValueError):
        return []
    found = []
    for tid in tids:
        try:
            fields = read_task_syscall(pid, tid)
        except TargetGone:
            continue
        if fields is None:
            raise refused(pid, PROC_ROOT, "cannot read the state of its threads")
        found.append((tid, fields))
    return found


def borrowable(number: int, arguments: list[int]) -> bool:
    """A thread waiting in system call ``number`` with ``arguments`` may be borrowed."""
    if number in BORROWABLE:
        return True
    index = MASK_ARGUMENT.get(number)
    return index is not None and index < len(arguments) and arguments[index] == 0


def blocked_signals(pid: int, tid: int) -> int | None:
    status = status_of(pid, tid=tid)
    return None if status is None else status.sig_blk


def waiting_threads(pid: int) -> list[int]:
    """Threads of ``pid`` waiting in a system call we may borrow them from, main first;
    and those in restart_syscall (a timed wait resumed after a stop), which only a
    CPython lock wait of the main thread is borrowed from (``lock_wait``)."""
    found = []
    for tid, fields in thread_syscalls(pid):
        try:
            number, arguments = int(fields[0]), [int(field, 16) for field in fields[1:7]]
        except (IndexError, ValueError):
            continue  # "running", or -1: not in a system call
        # Interruptible sleep only: a thread in uninterruptible sleep (D, disk or NFS I/O)
        # would keep the agent waiting for its stop.
        if (borrowable(number, arguments) or number == RESTART_SYSCALL) and thread_state(
                pid, tid) == "S":
            found.append(tid)
    return found


def in_kernel(fields: list[str]) -> bool:
    """A thread's syscall fields say it waits in a system call."""
    return bool(fields) and fields[0] not in ("running", "-1")


def same_process(pid: int, started: int | None) -> bool:
    """``pid`` is still the process that started at ``started`` ticks, and running."""
    return start_ticks(pid) == started and running(pid)


def exited_during_injection(pid: int) -> TargetNotFound:
    return TargetNotFound(f"process {pid} exited during the injection",
                          "attach to a running job", pid=pid)


def no_safe_point(pid: int, seconds: float) -> InjectionNotNow:
    return InjectionNotNow(
        f"process {pid} reached no safe point to queue the probe within {seconds:g} s "
        "(none of its threads waited in the kernel, and its main thread was never met "
        "in the eval loop's own code nor outside Python and libc); "
        "nothing was done to it",
        "the agent tries again on its next passes; or start the job with "
        "`dlprof-agent run -- python ...`", pid=pid)
