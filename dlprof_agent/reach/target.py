"""Checks the target pid before anything else starts, turning every way it can be
wrong into a one-line error with what to do about it."""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

from dlprof_agent.collectors.process import check_access
from dlprof_agent.collectors.procfs import PROC_ROOT, read_cmdline, read_executable
from dlprof_agent.errors import TargetAccessDenied, TargetGone, TargetNotFound, UsageError
from dlprof_agent.reach.procfs import start_ticks, user_name

PRIVILEGE_HINT = ("run the agent as the same user as the job, or as root, or grant it "
                  "CAP_SYS_PTRACE (in a container: --cap-add SYS_PTRACE)")


def _owner(process: psutil.Process) -> str:
    try:
        return user_name(process.uids().real)
    except psutil.Error:
        return "another user"


def open_target(pid: int, *, procfs: str = PROC_ROOT) -> psutil.Process:
    """Return the process for ``pid`` once it is known to exist and be readable."""
    if pid <= 0:
        raise UsageError(f"invalid pid {pid}", "give the positive pid of the training job")
    if pid == os.getpid():
        raise UsageError(f"pid {pid} is the agent itself", "give the training job's pid")
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            raise TargetNotFound(f"process {pid} has exited (zombie awaiting its parent)",
                                 "attach to a running job", pid=pid)
        check_access(pid, procfs=procfs)
        with process.oneshot():
            process.cpu_times()
            process.num_fds()
    except psutil.NoSuchProcess:
        raise TargetNotFound(f"no process with pid {pid}",
                             "check the pid with `ps -eo pid,user,args | grep python`",
                             pid=pid) from None
    except (psutil.AccessDenied, TargetAccessDenied):
        raise TargetAccessDenied(
            f"no permission to read process {pid} (owned by {_owner(process)})",
            PRIVILEGE_HINT, pid=pid) from None
    return process


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
    started = start_ticks(pid, procfs)
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
