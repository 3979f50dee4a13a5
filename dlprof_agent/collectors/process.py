"""The target process and, optionally, its descendants, read from procfs.

Each process's files are read once per interval (``ProcessFiles``), with the
values psutil gave for the same fields (its name, start time and counters). Descendants
(launcher ranks, data-loader workers) are reported each under its own pid, so
every counter stays monotonic: summing them here would make the total drop
whenever a worker exits.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from dlprof_agent.collectors.error_log import ErrorLog
from dlprof_agent.collectors.process_table import ProcessTable
from dlprof_agent.collectors.procfs import (
    CLOCK_TICKS_PER_SECOND,
    PROC_ROOT,
    ProcessFiles,
    Stat,
    Status,
    may_read_io,
    read_boot_time,
    read_cmdline_args,
    read_status,
)
from dlprof_agent.collectors.target import Target
from dlprof_agent.collectors.threads import ThreadGrouper, ThreadGroupSample
from dlprof_agent.errors import TargetAccessDenied, TargetGone

COLLECTOR = "process"
# Zombie and dead: the process has exited, whether or not it was reaped.
_EXITED = frozenset("ZX")
# psutil reads a whole command line for a long name; its first argument is enough.
CMDLINE_NAME_BYTES = 4096


@dataclass(frozen=True, slots=True)
class ProcessSample:
    pid: int
    ppid: int
    name: str
    is_target: bool  # False for a descendant of the target
    start_time_seconds: float  # unix time
    user_seconds: float
    system_seconds: float
    iowait_seconds: float  # waiting for block I/O (delay accounting), not CPU use
    rss_bytes: int
    vms_bytes: int
    rss_peak_bytes: int  # since the agent attached
    threads: int
    thread_groups: tuple[ThreadGroupSample, ...]
    voluntary_context_switches: int
    involuntary_context_switches: int
    # None where the kernel does not tell (no permission or no I/O accounting).
    read_bytes: int | None  # from storage
    write_bytes: int | None
    read_chars: int | None  # passed to read-like syscalls, page-cache hits included
    write_chars: int | None
    open_fds: int | None
    # Threads running or waiting for a CPU (state R) at the read; None where unread.
    runnable_threads: int | None = None
    # The main thread's time waiting in a run queue for a CPU, and on one
    # (/proc/<pid>/schedstat); None where the kernel keeps no schedstat.
    main_thread_wait_seconds: float | None = None
    main_thread_run_seconds: float | None = None


def read_peak_rss_bytes(pid: int, *, procfs: str = PROC_ROOT) -> int | None:
    """The kernel's resident high-water mark (VmHWM) since the process started."""
    try:
        status = read_status(pid, root=procfs)
    except TargetGone:
        return None
    return None if status is None else status.vm_hwm_bytes


class _PeakTracker:
    """Resident peak since attach.

    Sampled RSS misses spikes between samples. The kernel's VmHWM catches them
    but counts from process start, so it is used once it rises above its value
    at attach: from then on the peak happened after the agent attached.
    """

    def __init__(self, hwm_at_attach: int | None) -> None:
        self._hwm_at_attach = hwm_at_attach
        self.peak_bytes = 0

    def update(self, rss_bytes: int, hwm_bytes: int | None) -> int:
        self.peak_bytes = max(self.peak_bytes, rss_bytes)
        if (hwm_bytes is not None and self._hwm_at_attach is not None
                and hwm_bytes > self._hwm_at_attach):
            self.peak_bytes = max(self.peak_bytes, hwm_bytes)
        return self.peak_bytes


class _Tracked:
    """State kept per process between samples; a process is its pid and start."""

    def __init__(self, pid: int, start_ticks: int, procfs: str) -> None:
        self.pid = pid
        self.start_ticks = start_ticks
        self.start_time_seconds = start_ticks / CLOCK_TICKS_PER_SECOND + _boot_time(procfs)
        self.peak = _PeakTracker(read_peak_rss_bytes(pid, procfs=procfs))
        self.threads = ThreadGrouper()
        self.comm = ""
        self.name = ""


_BOOT_TIMES: dict[str, float] = {}


def _boot_time(procfs: str) -> float:
    # Read each time a process is first seen, as psutil reads it for its start
    # time; a process's start stays what it was then.
    _BOOT_TIMES[procfs] = read_boot_time(root=procfs)
    return _BOOT_TIMES[procfs]


def _name(state: _Tracked, comm: str, procfs: str) -> str:
    """psutil's name(): the kernel cuts a name at 15 characters, so a name that long
    is taken from the command line when that starts with it. Read again only when
    the process renames itself."""
    if comm == state.comm:
        return state.name
    name = comm
    if len(comm) >= 15:
        try:
            args = read_cmdline_args(state.pid, root=procfs, limit_bytes=CMDLINE_NAME_BYTES)
        except TargetGone:
            args = None
        if args:
            extended = os.path.basename(args[0])
            if extended.startswith(comm):
                name = extended
    state.comm, state.name = comm, name
    return name


class ProcessCollector:
    """Samples the process tree under ``target``, through the target's procfs (a captured
    tree in tests); its start time tells the target from a process that reuses its pid.

    ``table``: a ProcessTable its owner refreshes (the daemon's, shared by its
    targets), where the descendants are looked up; by default its own, refreshed
    at each lookup.
    """

    def __init__(
        self,
        target: Target,
        *,
        children: bool = True,
        errors: ErrorLog,
        table: ProcessTable | None = None,
        rescan_seconds: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.target = target
        self.pid = target.pid
        self.children = children
        self._errors = errors
        self._procfs = procfs = target.procfs
        self._root = _Tracked(target.pid, target.start_ticks, procfs)
        self._tracked: dict[int, _Tracked] = {target.pid: self._root}
        self._own_table = table is None
        self._table = ProcessTable(root=procfs) if table is None else table
        self._rescan_seconds = rescan_seconds
        self._clock = clock
        self._last_scan: float | None = None
        self._descendants_seen: list[tuple[int, int]] = []  # (pid, start ticks)
        self._excluded: frozenset[int] = frozenset()

    def set_excluded(self, pids: frozenset[int]) -> None:
        """Leave out these descendants and theirs: they are targets of their own
        (the daemon's ranks under a launcher), read there, not twice."""
        if pids != self._excluded:
            self._excluded = pids
            self._last_scan = None  # look again now

    def _descendants(self) -> list[tuple[int, int]]:
        """The target's descendants, looked up afresh every ``rescan_seconds``.

        Finding them means reading the stat file of every process on the host,
        most of the cost of a sample, while workers come and go over minutes.
        Between lookups the known ones are read; those that exit drop out.
        """
        now = self._clock()
        if self._last_scan is not None and now - self._last_scan < self._rescan_seconds:
            return self._descendants_seen
        self._last_scan = now
        try:
            if self._own_table:
                self._table.refresh()
        except OSError as error:
            self._errors.record(COLLECTOR, error)
            return self._descendants_seen
        table = self._table
        left_out = set(self._excluded)
        kept = []
        for pid in table.descendants(self.pid):  # each parent before its children
            entry = table.entries[pid]
            if pid in left_out or entry.ppid in left_out:
                left_out.add(pid)
            else:
                kept.append((pid, entry.start_ticks))
        self._descendants_seen = kept
        return kept

    def sample(self) -> tuple[ProcessSample, ...]:
        """Read the tree once. Raises ``TargetGone`` when the target has exited."""
        root = ProcessFiles(self.pid, root=self._procfs)
        try:
            stat = root.stat()
        except (TargetGone, ValueError, IndexError):
            raise TargetGone(self.pid) from None
        if (stat is None or stat.start_ticks != self._root.start_ticks
                or stat.state in _EXITED):
            raise TargetGone(self.pid)
        processes: list[tuple[ProcessFiles, int]] = [(root, self._root.start_ticks)]
        if self.children:
            processes += [(ProcessFiles(pid, root=self._procfs), start)
                          for pid, start in self._descendants()]

        tracked: dict[int, _Tracked] = {}
        samples: list[ProcessSample] = []
        for files, start_ticks in processes:
            pid = files.pid
            try:
                stat = files.stat()
                if stat is None:
                    raise PermissionError(f"no permission to read process {pid}")
                if stat.start_ticks != start_ticks:
                    continue  # its pid reused since the last lookup
                # A pid can be reused: a process is its pid and its start.
                known = self._tracked.get(pid)
                state = (known if known is not None and known.start_ticks == start_ticks
                         else _Tracked(pid, start_ticks, self._procfs))
                samples.append(self._read(state, files, stat))
            except (TargetGone, ValueError, IndexError):
                if pid == self.pid:
                    raise TargetGone(self.pid) from None
                continue  # a worker exited mid-read: normal churn, not an error
            except OSError as error:
                if pid == self.pid:
                    if isinstance(error, PermissionError):
                        raise TargetAccessDenied(f"no permission to read process {self.pid}",
                                                 pid=self.pid) from None
                    raise
                self._errors.record(COLLECTOR, f"pid {pid}: {error}")
                continue
            tracked[pid] = state
        self._tracked = tracked
        return tuple(samples)

    def _read(self, state: _Tracked, files: ProcessFiles, stat: Stat) -> ProcessSample:
        thread_stats = files.threads()
        status = files.status()
        schedstat = files.schedstat()
        io = files.io()
        hwm = None if status is None else status.vm_hwm_bytes
        threads = stat.threads if status is None or status.threads is None else status.threads
        return ProcessSample(
            pid=state.pid,
            ppid=stat.ppid,
            name=_name(state, stat.comm, self._procfs),
            is_target=state.pid == self.pid,
            start_time_seconds=state.start_time_seconds,
            user_seconds=stat.user_seconds,
            system_seconds=stat.system_seconds,
            iowait_seconds=stat.iowait_seconds,
            rss_bytes=stat.rss_bytes,
            vms_bytes=stat.vms_bytes,
            rss_peak_bytes=state.peak.update(stat.rss_bytes, hwm),
            threads=threads,
            thread_groups=state.threads.update(thread_stats),
            voluntary_context_switches=_switches(status, voluntary=True),
            involuntary_context_switches=_switches(status, voluntary=False),
            read_bytes=None if io is None else io.read_bytes,
            write_bytes=None if io is None else io.write_bytes,
            read_chars=None if io is None else io.read_chars,
            write_chars=None if io is None else io.write_chars,
            open_fds=files.open_fds(),
            runnable_threads=sum(1 for thread in thread_stats if thread.state == "R"),
            main_thread_wait_seconds=None if schedstat is None else schedstat.wait_seconds,
            main_thread_run_seconds=None if schedstat is None else schedstat.run_seconds,
        )


def _switches(status: Status | None, *, voluntary: bool) -> int:
    if status is None:
        raise PermissionError("no permission to read the process's status")
    value = (status.voluntary_context_switches if voluntary
             else status.involuntary_context_switches)
    return 0 if value is None else value


def check_access(pid: int, *, procfs: str = PROC_ROOT) -> None:
    """Raise ``TargetAccessDenied`` unless this process may read the target fully.

    /proc/<pid>/io needs the same check as ptrace read access: same user, or
    CAP_SYS_PTRACE.
    """
    if not may_read_io(pid, root=procfs):
        raise TargetAccessDenied(f"no permission to read process {pid}", pid=pid)
