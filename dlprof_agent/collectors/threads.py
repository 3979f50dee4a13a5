"""Per-thread CPU time grouped by thread name.

psutil reports per-thread CPU without names, so the threads come from the task
stat files (``collectors/procfs.py``): one read per thread gives its name, user,
system and block-I/O wait ticks. This module keeps the groups' counters.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dlprof_agent.collectors.procfs import (
    PROC_ROOT,
    ThreadStat,
    read_task_stats,
)

OTHER_THREAD_GROUP = "other"


@dataclass(frozen=True, slots=True)
class ThreadGroupSample:
    """Threads of one process that share a name, with their CPU summed."""

    name: str
    threads: int
    user_seconds: float
    system_seconds: float
    iowait_seconds: float


def read_thread_stats(pid: int, *, procfs: str = PROC_ROOT) -> list[ThreadStat]:
    """Every thread of ``pid``; threads that exit mid-read are left out. Raises
    TargetGone when the process has gone."""
    return list(read_task_stats(pid, root=procfs))


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
