"""The target process and, optionally, its descendants, read through psutil.

Each process is read in one ``oneshot()`` pass per interval. Descendants
(launcher ranks, data-loader workers) are reported each under its own pid, so
every counter stays monotonic: summing them here would make the total drop
whenever a worker exits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import psutil

from dlprof_agent.collectors.error_log import ErrorLog
from dlprof_agent.collectors.procfs import (
    PROC_ROOT,
    ProcessFiles,
    may_read_io,
    read_status,
)
from dlprof_agent.collectors.threads import ThreadGrouper, ThreadGroupSample
from dlprof_agent.errors import TargetAccessDenied, TargetGone

COLLECTOR = "process"
_T = TypeVar("_T")


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
    """State kept per process between samples."""

    def __init__(self, process: psutil.Process, procfs: str) -> None:
        self.process = process
        self.peak = _PeakTracker(read_peak_rss_bytes(process.pid, procfs=procfs))
        self.threads = ThreadGrouper()


class ProcessCollector:
    """Samples one process tree.

    ``process_factory`` and ``procfs`` are the data sources; tests pass fakes.
    """

    def __init__(
        self,
        pid: int,
        *,
        children: bool = True,
        errors: ErrorLog,
        procfs: str = PROC_ROOT,
        process_factory: Callable[[int], psutil.Process] = psutil.Process,
        rescan_seconds: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pid = pid
        self.children = children
        self._errors = errors
        self._procfs = procfs
        try:
            self._root = process_factory(pid)
            self._tracked: dict[int, _Tracked] = {pid: _Tracked(self._root, procfs)}
        except psutil.NoSuchProcess:
            raise TargetGone(pid) from None
        except psutil.AccessDenied:
            raise TargetAccessDenied(f"no permission to read process {pid}", pid=pid) from None
        self._rescan_seconds = rescan_seconds
        self._clock = clock
        self._last_scan: float | None = None
        self._descendants_seen: list[psutil.Process] = []
        self._excluded: frozenset[int] = frozenset()

    def set_excluded(self, pids: frozenset[int]) -> None:
        """Leave out these descendants and theirs: they are targets of their own
        (the daemon's ranks under a launcher), read there, not twice."""
        if pids != self._excluded:
            self._excluded = pids
            self._last_scan = None  # look again now

    def _descendants(self) -> list[psutil.Process]:
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
            self._descendants_seen = self._without_excluded(self._root.children(recursive=True))
        except psutil.Error as error:
            self._errors.record(COLLECTOR, error)
        return self._descendants_seen

    def _without_excluded(self, found: list[psutil.Process]) -> list[psutil.Process]:
        if not self._excluded:
            return found
        left_out = set(self._excluded)
        kept = []
        for process in found:  # psutil lists each parent before its children
            try:
                parent = process.ppid()
            except psutil.Error:
                continue
            if process.pid in left_out or parent in left_out:
                left_out.add(process.pid)
            else:
                kept.append(process)
        return kept

    def sample(self) -> tuple[ProcessSample, ...]:
        """Read the tree once. Raises ``TargetGone`` when the target has exited."""
        try:
            if not self._root.is_running() or self._root.status() == psutil.STATUS_ZOMBIE:
                raise TargetGone(self.pid)
        except psutil.NoSuchProcess:
            raise TargetGone(self.pid) from None
        processes = [self._root]
        if self.children:
            processes += self._descendants()

        tracked: dict[int, _Tracked] = {}
        samples: list[ProcessSample] = []
        for process in processes:
            if process is not self._root and not process.is_running():
                continue  # exited, or its pid reused since the last lookup
            # A pid can be reused; psutil's identity check includes the start time.
            known = self._tracked.get(process.pid)
            state = known if known is not None and known.process == process else None
            if state is None:
                state = _Tracked(process, self._procfs)
            try:
                samples.append(self._read(state))
            except psutil.NoSuchProcess:
                if process.pid == self.pid:
                    raise TargetGone(self.pid) from None
                continue  # a worker exited mid-read: normal churn, not an error
            except (psutil.AccessDenied, OSError) as error:
                if process.pid == self.pid:
                    if isinstance(error, (psutil.AccessDenied, PermissionError)):
                        raise TargetAccessDenied(f"no permission to read process {self.pid}",
                                                 pid=self.pid) from None
                    raise
                self._errors.record(COLLECTOR, f"pid {process.pid}: {error}")
                continue
            tracked[process.pid] = state
        self._tracked = tracked
        return tuple(samples)

    def _read(self, state: _Tracked) -> ProcessSample:
        process = state.process
        with process.oneshot():
            cpu = process.cpu_times()
            memory = process.memory_info()
            switches = process.num_ctx_switches()
            ppid = process.ppid()
            name = process.name()
            start_time = process.create_time()
            threads = process.num_threads()
            io = _optional(process.io_counters)
            open_fds = _optional(process.num_fds)
        files = ProcessFiles(process.pid, root=self._procfs)
        try:
            thread_stats = files.threads()
            status = files.status()
            schedstat = files.schedstat()
        except TargetGone:
            raise psutil.NoSuchProcess(process.pid) from None
        thread_groups = state.threads.update(thread_stats)
        hwm = None if status is None else status.vm_hwm_bytes
        return ProcessSample(
            pid=process.pid,
            ppid=ppid,
            name=name,
            is_target=process.pid == self.pid,
            start_time_seconds=start_time,
            user_seconds=cpu.user,
            system_seconds=cpu.system,
            iowait_seconds=getattr(cpu, "iowait", 0.0),
            rss_bytes=memory.rss,
            vms_bytes=memory.vms,
            rss_peak_bytes=state.peak.update(memory.rss, hwm),
            threads=threads,
            thread_groups=thread_groups,
            voluntary_context_switches=switches.voluntary,
            involuntary_context_switches=switches.involuntary,
            read_bytes=getattr(io, "read_bytes", None),
            write_bytes=getattr(io, "write_bytes", None),
            read_chars=getattr(io, "read_chars", None),
            write_chars=getattr(io, "write_chars", None),
            open_fds=open_fds,
            runnable_threads=sum(1 for stat in thread_stats if stat.state == "R"),
            main_thread_wait_seconds=None if schedstat is None else schedstat.wait_seconds,
            main_thread_run_seconds=None if schedstat is None else schedstat.run_seconds,
        )


def _optional(read: Callable[[], _T]) -> _T | None:
    """A field the kernel may refuse or lack; the rest of the sample still counts."""
    try:
        return read()
    except (psutil.AccessDenied, NotImplementedError, AttributeError):
        return None


def check_access(pid: int, *, procfs: str = PROC_ROOT) -> None:
    """Raise ``TargetAccessDenied`` unless this process may read the target fully.

    /proc/<pid>/io needs the same check as ptrace read access: same user, or
    CAP_SYS_PTRACE.
    """
    if not may_read_io(pid, root=procfs):
        raise TargetAccessDenied(f"no permission to read process {pid}", pid=pid)
