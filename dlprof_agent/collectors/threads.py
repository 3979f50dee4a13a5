"""Per-thread CPU time from procfs, grouped by thread name.

psutil reports per-thread CPU without names, so the thread stat files are read
here directly: one read per thread gives its name, user, system and block-I/O
wait ticks.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

CLOCK_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

# Field positions after the ")" that ends the command name in /proc/*/stat
# (proc(5) numbers them from 1 and counts pid and comm as fields 1 and 2).
_UTIME = 14 - 3
_STIME = 15 - 3
_BLKIO_TICKS = 42 - 3

OTHER_THREAD_GROUP = "other"


@dataclass(frozen=True, slots=True)
class ThreadStat:
    tid: int
    name: str
    user_seconds: float
    system_seconds: float
    iowait_seconds: float
    state: str = ""  # scheduler state at the read: R runs or waits for a CPU, S sleeps, ...


@dataclass(frozen=True, slots=True)
class ThreadGroupSample:
    """Threads of one process that share a name, with their CPU summed."""

    name: str
    threads: int
    user_seconds: float
    system_seconds: float
    iowait_seconds: float


def parse_stat_line(line: str) -> tuple[str, list[str]]:
    """Split a /proc stat line into (comm, fields after comm).

    The name sits in parentheses and may itself hold spaces or ")".
    """
    open_paren = line.index("(")
    close_paren = line.rindex(")")
    return line[open_paren + 1 : close_paren], line[close_paren + 2 :].split()


def read_thread_stats(pid: int, *, procfs: str = "/proc") -> list[ThreadStat]:
    """Read every thread of ``pid``. Threads that exit mid-read are skipped."""
    task_dir = f"{procfs}/{pid}/task"
    stats: list[ThreadStat] = []
    for entry in os.listdir(task_dir):
        try:
            with open(f"{task_dir}/{entry}/stat") as stat_file:
                line = stat_file.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        name, fields = parse_stat_line(line)
        blkio_ticks = int(fields[_BLKIO_TICKS]) if len(fields) > _BLKIO_TICKS else 0
        stats.append(
            ThreadStat(
                tid=int(entry),
                name=name,
                user_seconds=int(fields[_UTIME]) / CLOCK_TICKS_PER_SECOND,
                system_seconds=int(fields[_STIME]) / CLOCK_TICKS_PER_SECOND,
                iowait_seconds=blkio_ticks / CLOCK_TICKS_PER_SECOND,
                state=fields[0],
            )
        )
    return stats


@dataclass
class _GroupTotals:
    threads: int = 0
    user_seconds: float = 0.0
    system_seconds: float = 0.0
    iowait_seconds: float = 0.0

    def add(self, user: float, system: float, iowait: float) -> None:
        self.user_seconds += user
        self.system_seconds += system
        self.iowait_seconds += iowait


def _went_back(before: ThreadStat, after: ThreadStat) -> bool:
    return (after.user_seconds < before.user_seconds
            or after.system_seconds < before.system_seconds
            or after.iowait_seconds < before.iowait_seconds)


@dataclass(frozen=True, slots=True)
class _Member:
    group: str
    name: str
    baseline: ThreadStat | None  # CPU when it joined the group, None if from birth
    last: ThreadStat

    def used(self) -> tuple[float, float, float]:
        """CPU seconds (user, system, iowait) spent while in this group."""
        base = self.baseline
        if base is None:
            return self.last.user_seconds, self.last.system_seconds, self.last.iowait_seconds
        return (self.last.user_seconds - base.user_seconds,
                self.last.system_seconds - base.system_seconds,
                self.last.iowait_seconds - base.iowait_seconds)


class ThreadGrouper:
    """Keeps thread-group CPU counters monotonic across thread exits and renames.

    Summing the live threads alone would make a group's counter drop whenever a
    worker exits, which Prometheus reads as a counter reset. The CPU time of
    threads that have gone is kept per group instead. A renamed thread counts
    towards its new group only from the rename on, so no time is counted twice.
    """

    def __init__(self, *, max_groups: int = 64) -> None:
        self._max_groups = max_groups
        self._retired: dict[str, _GroupTotals] = {}
        self._members: dict[int, _Member] = {}

    def _group_name(self, thread_name: str) -> str:
        if thread_name in self._retired or len(self._retired) < self._max_groups:
            return thread_name
        return OTHER_THREAD_GROUP

    def update(self, stats: Iterable[ThreadStat]) -> tuple[ThreadGroupSample, ...]:
        members: dict[int, _Member] = {}
        left: list[_Member] = []
        for stat in stats:
            previous = self._members.pop(stat.tid, None)
            if previous is not None and _went_back(previous.last, stat):
                # The tid was reused by a new thread between samples: the old one
                # exited, and the new one starts from zero like any newborn.
                left.append(previous)
                previous = None
            if previous is not None and previous.name == stat.name:
                members[stat.tid] = _Member(previous.group, stat.name, previous.baseline, stat)
                continue
            if previous is not None:
                left.append(previous)
            group = self._group_name(stat.name)
            self._retired.setdefault(group, _GroupTotals())
            baseline = previous.last if previous is not None else None
            members[stat.tid] = _Member(group, stat.name, baseline, stat)
        # Threads not seen again have exited; renamed ones have left their group.
        for member in [*self._members.values(), *left]:
            self._retired[member.group].add(*member.used())
        self._members = members

        totals = {name: _GroupTotals(0, r.user_seconds, r.system_seconds, r.iowait_seconds)
                  for name, r in self._retired.items()}
        for member in members.values():
            total = totals[member.group]
            total.threads += 1
            total.add(*member.used())
        return tuple(
            ThreadGroupSample(name, t.threads, t.user_seconds, t.system_seconds,
                              t.iowait_seconds)
            for name, t in sorted(totals.items())
        )
