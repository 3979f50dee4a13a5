"""What the target checks and the injectors ask of a process, read through the one
/proc reader (``collectors/procfs.py``). Each returns None (or nothing) for a process
that is gone or not ours to read, unless it says otherwise."""

from __future__ import annotations

from dlprof_agent.collectors.procfs import (
    PROC_ROOT,
    Mapping,
    Status,
    read_comm,
    read_memory_map,
    read_stat,
    read_state,
    read_status,
)
from dlprof_agent.errors import TargetGone, TargetNotFound


def status_of(pid: int | str, *, tid: int | None = None,
              procfs: str = PROC_ROOT) -> Status | None:
    """The status of ``pid`` ("self" too) or of its thread ``tid``."""
    try:
        return read_status(pid, tid=tid, root=procfs)
    except (TargetGone, ValueError):
        return None


def start_ticks(pid: int, procfs: str = PROC_ROOT) -> int | None:
    """Field 22 of /proc/<pid>/stat, the start time in clock ticks since boot: a pid
    reused by another process has another."""
    try:
        stat = read_stat(pid, root=procfs)
    except (TargetGone, ValueError, IndexError):
        return None
    return None if stat is None else stat.start_ticks


def thread_state(pid: int, tid: int) -> str | None:
    """The scheduler state letter of thread ``tid`` of ``pid``."""
    try:
        stat = read_stat(pid, tid=tid)
    except (TargetGone, ValueError, IndexError):
        return None
    return None if stat is None else stat.state


def comm(pid: int, procfs: str = PROC_ROOT) -> str:
    """The process's name, "?" when it cannot be read."""
    try:
        return read_comm(pid, root=procfs) or "?"
    except TargetGone:
        return "?"


def running(pid: int, procfs: str = PROC_ROOT) -> bool:
    """There is such a process and it has not exited (a zombie has)."""
    return read_state(pid, root=procfs) not in (None, "Z", "X")


def raise_if_gone(pid: int, procfs: str = PROC_ROOT) -> None:
    """The process behind a failed /proc read: TargetNotFound when there is none left."""
    state = read_state(pid, root=procfs)
    if state is None:
        raise TargetNotFound(f"no process with pid {pid}",
                             "check the pid with `ps -eo pid,user,args | grep python`", pid=pid)
    if state in ("Z", "X"):
        raise TargetNotFound(f"process {pid} has exited", "attach to a running job", pid=pid)


def memory_map(pid: int) -> list[Mapping]:
    """Each mapping of ``pid``; empty when it cannot be read."""
    try:
        return read_memory_map(pid) or []
    except TargetGone:
        return []
