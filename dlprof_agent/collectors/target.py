"""The process a command is about, as one value: its pid, its start time and the
procfs it is read through (psutil's ``Process`` is the model). A pid alone can
name another process once the job has exited and the pid is reused; a Target
cannot, and ``Target.is_running`` is the one place that checks it.

``open_target`` makes the Target of a pid a user gave, turning every way it can
be wrong into a one-line error with what to do about it."""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass

from dlprof_agent.collectors.procfs import (
    PROC_ROOT,
    count_fds,
    may_read_io,
    owner_uid,
    read_cmdline,
    read_comm,
    read_executable,
    read_stat,
    read_state,
)
from dlprof_agent.errors import TargetAccessDenied, TargetGone, TargetNotFound, UsageError

PRIVILEGE_HINT = ("run the agent as the same user as the job, or as root, or grant it "
                  "CAP_SYS_PTRACE (in a container: --cap-add SYS_PTRACE)")
_EXITED = frozenset("ZX")  # zombie, dead: the process has exited


@dataclass(frozen=True)
class Target:
    pid: int
    start_ticks: int  # /proc/<pid>/stat field 22, clock ticks since boot
    procfs: str = PROC_ROOT

    @classmethod
    def of(cls, pid: int, *, procfs: str = PROC_ROOT) -> Target:
        """The process that has ``pid`` now. Raises TargetGone when there is none (or
        it has exited) and TargetAccessDenied when its stat may not be read."""
        try:
            stat = read_stat(pid, root=procfs)
        except (ValueError, IndexError):
            raise TargetGone(pid) from None
        if stat is None:
            raise TargetAccessDenied(f"no permission to read process {pid}", pid=pid)
        if stat.state in _EXITED:
            raise TargetGone(pid)
        return cls(pid, stat.start_ticks, procfs)

    def is_running(self) -> bool:
        """The same process still runs: ``pid`` has not exited, nor been reused."""
        try:
            stat = read_stat(self.pid, root=self.procfs)
        except (TargetGone, ValueError, IndexError):
            return False
        return (stat is not None and stat.start_ticks == self.start_ticks
                and stat.state not in _EXITED)

    def name(self) -> str:
        """Its name (/proc/<pid>/comm), "" when it cannot be read."""
        try:
            return read_comm(self.pid, root=self.procfs) or ""
        except TargetGone:
            return ""

    def __str__(self) -> str:
        return f"process {self.pid}"


def user_name(uid: int) -> str:
    """"user alice", or "uid 1234" where the name is unknown here."""
    try:
        return f"user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"uid {uid}"


def owner(pid: int, procfs: str = PROC_ROOT) -> str:
    """Who owns process ``pid``, in words."""
    try:
        return user_name(owner_uid(pid, root=procfs))
    except TargetGone:
        return "another user"


def open_target(pid: int, *, procfs: str = PROC_ROOT) -> Target:
    """The Target of ``pid``, once it is known to exist and be readable in full."""
    if pid <= 0:
        raise UsageError(f"invalid pid {pid}", "give the positive pid of the training job")
    if pid == os.getpid():
        raise UsageError(f"pid {pid} is the agent itself", "give the training job's pid")
    try:
        target = Target.of(pid, procfs=procfs)
        # /proc/<pid>/io and fd need ptrace read access: same user, or CAP_SYS_PTRACE.
        if not may_read_io(pid, root=procfs) or count_fds(pid, root=procfs) is None:
            raise TargetAccessDenied(f"no permission to read process {pid}", pid=pid)
    except TargetGone:
        if read_state(pid, root=procfs) in _EXITED:
            raise TargetNotFound(f"process {pid} has exited (zombie awaiting its parent)",
                                 "attach to a running job", pid=pid) from None
        raise TargetNotFound(f"no process with pid {pid}",
                             "check the pid with `ps -eo pid,user,args | grep python`",
                             pid=pid) from None
    except TargetAccessDenied:
        raise TargetAccessDenied(
            f"no permission to read process {pid} (owned by {owner(pid, procfs)})",
            PRIVILEGE_HINT, pid=pid) from None
    return target


@dataclass(frozen=True)
class ProgramIdentity:
    """What program a pid runs. exec keeps the pid and its start time, and
    changes these: the target is then another program."""

    start_ticks: int  # /proc/<pid>/stat field 22: a reused pid has another
    executable: str
    command: str

    def describe(self) -> str:
        command = self.command if len(self.command) <= 120 else self.command[:117] + "..."
        return f"`{command}` ({self.executable})"


def program_identity(pid: int, *, procfs: str = PROC_ROOT) -> ProgramIdentity | None:
    """None when it cannot be read (gone, or not ours to read)."""
    started = _start_ticks(pid, procfs)
    if started is None:
        return None
    try:
        executable = read_executable(pid, root=procfs)
        command = read_cmdline(pid, root=procfs)
    except TargetGone:
        return None
    if not executable or command is None:
        return None
    return ProgramIdentity(started, executable, command)


def _start_ticks(pid: int, procfs: str) -> int | None:
    try:
        stat = read_stat(pid, root=procfs)
    except (TargetGone, ValueError, IndexError):
        return None
    return None if stat is None else stat.start_ticks
