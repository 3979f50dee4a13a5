"""The injector's one /proc front: what the injectors and the target checks ask of
a process, and the paths they open in it (its memory, its root, its mapped files).
``collectors/procfs.py`` is the agent's; only these two build /proc paths.

One convention: every function takes the process's ``pid`` first (a thread's
``tid`` beside it where it is about one thread) and the procfs root as ``procfs``
(``PROC_ROOT`` by default, a captured tree in tests). A reader returns None (or
nothing) for a process that is gone or not ours to read, unless it says
otherwise; a ``*_path`` function only names a path and reads nothing."""

from __future__ import annotations

import errno
import os
from typing import BinaryIO

from dlprof_agent.collectors.procfs import (
    ENVIRON_MAX_BYTES,
    PROC_ROOT,
    Mapping,
    Stat,
    Status,
    parse_maps,
    parse_stat,
    parse_status,
    read_file_bytes,
)
from dlprof_agent.errors import TargetGone, TargetNotFound

# Re-exported: the injectors take the procfs root and the map type from here too.
__all__ = ["PROC_ROOT", "Mapping"]

_EXITED = ("Z", "X")  # zombie, dead


def process_path(pid: int | str, *parts: object, procfs: str = PROC_ROOT) -> str:
    """``procfs/pid/part/part...``."""
    return "/".join((procfs, str(pid), *(str(part) for part in parts)))


def inside_root_path(pid: int, path: str, *, procfs: str = PROC_ROOT) -> str:
    """``path`` as process ``pid`` sees it (through its root: another container's /tmp)."""
    return process_path(pid, "root", procfs=procfs) + path


def mapped_file_path(pid: int, start: int, end: int, *, procfs: str = PROC_ROOT) -> str:
    """The file mapped at ``start``-``end`` in ``pid``, even when deleted since."""
    return process_path(pid, "map_files", f"{start:x}-{end:x}", procfs=procfs)


def executable_path(pid: int, *, procfs: str = PROC_ROOT) -> str:
    """The process's executable, openable even from another mount namespace."""
    return process_path(pid, "exe", procfs=procfs)


def open_memory(pid: int, *, writable: bool = False, procfs: str = PROC_ROOT) -> BinaryIO:
    """The process's memory, unbuffered (seek to an address, then read or write).
    Raises OSError as open() does: the injectors tell its causes apart."""
    return open(process_path(pid, "mem", procfs=procfs), "r+b" if writable else "rb",
                buffering=0)


def _read_text(pid: int | str, name: str, *, tid: int | None = None, procfs: str = PROC_ROOT,
               records: bool = False) -> str | None:
    """A file of the process (or of its thread ``tid``); None when it may not be read
    or this kernel lacks it. Raises TargetGone when the process or thread has gone."""
    directory = (process_path(pid, procfs=procfs) if tid is None
                 else process_path(pid, "task", tid, procfs=procfs))
    try:
        return read_file_bytes(f"{directory}/{name}", records=records).decode(
            errors="replace")
    except PermissionError:
        return None
    except OSError as error:
        if error.errno not in (errno.ENOENT, errno.ESRCH):
            raise
        if error.errno == errno.ENOENT and os.path.isdir(directory):
            return None  # the process is there; this file is not
        raise TargetGone(pid if isinstance(pid, int) else os.getpid()) from None


def _stat(pid: int, *, tid: int | None = None, procfs: str = PROC_ROOT) -> Stat | None:
    try:
        text = _read_text(pid, "stat", tid=tid, procfs=procfs)
        return None if text is None else parse_stat(text)
    except (TargetGone, ValueError, IndexError):
        return None


def status_of(pid: int | str, *, tid: int | None = None, procfs: str = PROC_ROOT) -> Status | None:
    """The status of ``pid`` ("self" too) or of its thread ``tid``."""
    try:
        text = _read_text(pid, "status", tid=tid, procfs=procfs)
        return None if text is None else parse_status(text)
    except (TargetGone, ValueError):
        return None


def state(pid: int, *, procfs: str = PROC_ROOT) -> str | None:
    """The one-letter scheduler state of ``pid``: Z (zombie) and X (dead) have exited."""
    stat = _stat(pid, procfs=procfs)
    return None if stat is None else stat.state


def thread_state(pid: int, tid: int, *, procfs: str = PROC_ROOT) -> str | None:
    """The scheduler state letter of thread ``tid`` of ``pid``."""
    stat = _stat(pid, tid=tid, procfs=procfs)
    return None if stat is None else stat.state


def comm(pid: int, *, procfs: str = PROC_ROOT) -> str:
    """The process's name, "?" when it cannot be read."""
    try:
        text = _read_text(pid, "comm", procfs=procfs)
    except TargetGone:
        return "?"
    return (text or "").strip() or "?"


def running(pid: int, *, procfs: str = PROC_ROOT) -> bool:
    """There is such a process and it has not exited (a zombie has)."""
    return state(pid, procfs=procfs) not in (None, *_EXITED)


def raise_if_gone(pid: int, *, procfs: str = PROC_ROOT) -> None:
    """The process behind a failed /proc read: TargetNotFound when there is none left."""
    letter = state(pid, procfs=procfs)
    if letter is None:
        raise TargetNotFound(f"no process with pid {pid}",
                             "check the pid with `ps -eo pid,user,args | grep python`", pid=pid)
    if letter in _EXITED:
        raise TargetNotFound(f"process {pid} has exited", "attach to a running job", pid=pid)


def read_memory_map(pid: int, *, procfs: str = PROC_ROOT) -> list[Mapping] | None:
    """Each mapping of ``pid``; None when the agent may not read them. Raises
    TargetGone for a process that has gone."""
    text = _read_text(pid, "maps", procfs=procfs, records=True)
    return None if text is None else parse_maps(text)


def memory_map(pid: int, *, procfs: str = PROC_ROOT) -> list[Mapping]:
    """Each mapping of ``pid``; empty when it cannot be read."""
    try:
        return read_memory_map(pid, procfs=procfs) or []
    except TargetGone:
        return []


def executable(pid: int, *, procfs: str = PROC_ROOT) -> str | None:
    """Where the executable was, as the process sees it; "" for a process that has none
    (a kernel thread), None without permission. Raises TargetGone for one that has gone."""
    try:
        return os.readlink(executable_path(pid, procfs=procfs))
    except PermissionError:
        return None
    except OSError as error:
        if error.errno in (errno.ENOENT, errno.ESRCH) and not os.path.isdir(
                process_path(pid, procfs=procfs)):
            raise TargetGone(pid) from None
        return ""


def environment_value(pid: int, name: str, *, procfs: str = PROC_ROOT) -> str | None:
    """The value of ``name`` in the process's environment as it started; None when it
    is unset or cannot be read."""
    try:
        with open(process_path(pid, "environ", procfs=procfs), "rb") as file:
            raw = file.read(ENVIRON_MAX_BYTES)
    except OSError:
        return None
    prefix = name.encode() + b"="
    return next((entry[len(prefix):].decode(errors="replace") for entry in raw.split(b"\0")
                 if entry.startswith(prefix)), None)


def read_root(pid: int, *, procfs: str = PROC_ROOT) -> str | None:
    """Where the process's root directory is as the agent sees it: "/" for the agent's
    own (or another mount namespace's), the directory of a chroot; None when it cannot
    be read."""
    try:
        return os.readlink(process_path(pid, "root", procfs=procfs))
    except OSError:
        return None


def list_tasks(pid: int, *, procfs: str = PROC_ROOT) -> list[int]:
    """The thread ids of ``pid``, the main thread first; empty when they may not be
    listed. Raises TargetGone for a process that has gone."""
    try:
        names = os.listdir(process_path(pid, "task", procfs=procfs))
    except PermissionError:
        return []
    except OSError as error:
        if error.errno in (errno.ENOENT, errno.ESRCH):
            raise TargetGone(pid) from None
        raise
    return sorted((int(name) for name in names if name.isdigit()), key=lambda tid: tid != pid)


def read_task_syscall(pid: int, tid: int, *, procfs: str = PROC_ROOT) -> list[str] | None:
    """The fields of a thread's syscall file: the number and arguments of the system
    call it waits in, or "running" or -1. None when the agent may not read it (the
    file needs ptrace access); raises TargetGone when the thread has ended."""
    text = _read_text(pid, "syscall", tid=tid, procfs=procfs)
    return None if text is None else text.split()


def read_ptrace_scope(*, procfs: str = PROC_ROOT) -> str | None:
    """Yama's ptrace_scope ("0" to "3"), None where Yama is absent."""
    try:
        with open("/".join((procfs, "sys", "kernel", "yama", "ptrace_scope"))) as file:
            return file.read().strip()
    except OSError:
        return None
