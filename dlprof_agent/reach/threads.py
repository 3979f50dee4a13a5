"""The threads of a process the injectors may act through: those that wait in the
kernel (``/proc/<pid>/task/*/syscall``). A thread there is between two pieces of C
code, so it cannot be inside the pending-call lock's critical section, which has no
system call in it. Also what the injectors say when none waits, or when the process
went away under them."""

from __future__ import annotations

from dlprof_agent.collectors.procfs import PROC_ROOT, list_tasks, read_task_syscall
from dlprof_agent.errors import InjectionNotNow, TargetGone, TargetNotFound
from dlprof_agent.reach.procfs import running, start_ticks
from dlprof_agent.reach.refusal import refused

POLL_SECONDS = 0.005  # between looks at the threads' states


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
        "outside Python and libc: it runs Python code without a pause, holding the GIL); "
        "nothing was done to it",
        "the agent tries again on its next passes; or start the job with "
        "`dlprof-agent run -- python ...`", pid=pid)
