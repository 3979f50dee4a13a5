"""Small reads of /proc that the target checks and the injectors share. Each returns
None (or nothing) for a process that is gone or not ours to read, unless it says
otherwise."""

from __future__ import annotations

import os
import pwd

from dlprof_agent.collectors.process import read_state
from dlprof_agent.errors import TargetNotFound

# One mapping of /proc/<pid>/maps: start, end, permissions, file offset, path ("" if none).
Mapping = tuple[int, int, str, int, str]


def read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return file.read()
    except OSError:
        return None


def status_field(pid: int | str, field: str, procfs: str = "/proc") -> str | None:
    """One field of /proc/<pid>/status (``pid`` may be "self" or "<pid>/task/<tid>")."""
    for line in (read_text(f"{procfs}/{pid}/status") or "").splitlines():
        key, _, value = line.partition(":")
        if key == field:
            return value.strip()
    return None


def hex_status_field(pid: int | str, field: str, procfs: str = "/proc") -> int | None:
    """A bit mask of /proc/<pid>/status (CapEff, SigBlk, ...)."""
    value = status_field(pid, field, procfs)
    try:
        return int(value, 16) if value is not None else None
    except ValueError:
        return None


def start_ticks(pid: int, procfs: str = "/proc") -> int | None:
    """Field 22 of /proc/<pid>/stat, the start time in clock ticks since boot: a pid
    reused by another process has another."""
    text = read_text(f"{procfs}/{pid}/stat")
    if text is None:
        return None
    try:
        return int(text.rpartition(")")[2].split()[19])
    except (IndexError, ValueError):
        return None


def running(pid: int, procfs: str = "/proc") -> bool:
    """There is such a process and it has not exited (a zombie has)."""
    return read_state(pid, procfs=procfs) not in (None, "Z", "X")


def raise_if_gone(pid: int, procfs: str = "/proc") -> None:
    """The process behind a failed /proc read: TargetNotFound when there is none left."""
    state = read_state(pid, procfs=procfs)
    if state is None:
        raise TargetNotFound(f"no process with pid {pid}",
                             "check the pid with `ps -eo pid,user,args | grep python`", pid=pid)
    if state in ("Z", "X"):
        raise TargetNotFound(f"process {pid} has exited", "attach to a running job", pid=pid)


def memory_map(pid: int) -> list[Mapping]:
    """Each mapping of ``pid``; empty when it cannot be read."""
    mappings = []
    for line in (read_text(f"/proc/{pid}/maps") or "").splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 5:
            continue
        start, _, end = fields[0].partition("-")
        mappings.append((int(start, 16), int(end, 16), fields[1], int(fields[2], 16),
                         fields[5] if len(fields) == 6 else ""))
    return mappings


def user_name(uid: int) -> str:
    """"user alice", or "uid 1234" where the name is unknown here."""
    try:
        return f"user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"uid {uid}"


def owner(pid: int, procfs: str = "/proc") -> str:
    """Who owns process ``pid``, in words."""
    try:
        return user_name(os.stat(f"{procfs}/{pid}").st_uid)
    except OSError:
        return "another user"
