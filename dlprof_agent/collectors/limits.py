"""What a process may use: the CPUs its affinity allows, its cgroup's CPU quota
and memory limit, and how often it ran into that limit.

Read from procfs and the cgroup filesystem, cgroup v2 or v1 (hybrid hosts mount
the v1 memory and cpu controllers beside an empty v2 tree). A limit along the
way up the hierarchy binds the job too, so the tightest one counts. Every field
the host does not provide is None.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from dlprof_agent.collectors.procfs import mounts_path, read_cgroups, read_file_bytes
from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import TargetGone

# A job's cgroup, affinity and limits change only when someone changes them.
LIMITS_REFRESH_SECONDS = 5.0
# cgroup v1 writes "no limit" as the largest page-aligned 63-bit number.
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True, slots=True)
class LimitsSample:
    affinity_cpus: int | None  # CPUs the scheduler may run the process on
    cpu_quota_cores: float | None  # cgroup CPU bandwidth (quota / period); None: no quota
    memory_limit_bytes: int | None  # tightest cgroup memory limit; None: no limit
    memory_usage_bytes: int | None  # the cgroup's charge, page cache included
    memory_limit_hits: int | None  # times the cgroup hit its limit and had to reclaim
    memory_stall_ratio: float | None  # PSI: share of the last 10 s some task waited on memory

    @property
    def allowed_cpus(self) -> float | None:
        """The cores the job can keep busy at once: affinity or quota, the fewer."""
        known = [c for c in (self.affinity_cpus, self.cpu_quota_cores) if c is not None]
        return min(known) if known else None


def _read(path: str) -> str | None:
    try:
        return read_file_bytes(path).decode().strip()
    except (OSError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class _Mounts:
    v2: str | None  # cgroup2 mount
    v1: dict[str, str]  # v1 controller -> its mount

    @classmethod
    def read(cls, mounts_file: str) -> _Mounts:
        v2: str | None = None
        v1: dict[str, str] = {}
        for line in (_read(mounts_file) or "").splitlines():
            fields = line.split()
            if len(fields) < 4:
                continue
            if fields[2] == "cgroup2" and v2 is None:
                v2 = fields[1]
            elif fields[2] == "cgroup":
                for option in fields[3].split(","):
                    if option in ("memory", "cpu"):
                        v1.setdefault(option, fields[1])
        return cls(v2, v1)


def _cgroup_paths(pid: int, procfs: str) -> dict[str, str]:
    """Controller ("" for v2) -> the process's cgroup path."""
    paths: dict[str, str] = {}
    try:
        entries = read_cgroups(pid, root=procfs) or ()
    except TargetGone:
        entries = ()
    for entry in entries:
        for controller in entry.controllers or ("",):
            paths[controller] = entry.path
    return paths


def _levels(mount: str, path: str) -> list[str]:
    """The cgroup's folder and each parent's, up to the mount, innermost first."""
    parts = [p for p in path.split("/") if p and p != ".."]
    return [os.path.join(mount, *parts[:depth]) for depth in range(len(parts), -1, -1)]


def _tightest(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def _v2_cpu_max(text: str | None) -> float | None:
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def _v2_memory_max(text: str | None) -> float | None:
    return None if not text or text == "max" else float(int(text))


def _v1_cpu_quota(folder: str) -> float | None:
    quota, period = _read(f"{folder}/cpu.cfs_quota_us"), _read(f"{folder}/cpu.cfs_period_us")
    if quota is None or period is None or int(quota) <= 0:
        return None
    return int(quota) / int(period)


def _v1_memory_limit(folder: str) -> float | None:
    text = _read(f"{folder}/memory.limit_in_bytes")
    return None if text is None or int(text) >= _V1_UNLIMITED else float(int(text))


def _psi_some_avg10(text: str | None) -> float | None:
    for line in (text or "").splitlines():
        if line.startswith("some "):
            for field in line.split()[1:]:
                key, _, value = field.partition("=")
                if key == "avg10":
                    return float(value) / 100
    return None


def _events_max(text: str | None) -> int | None:
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if key == "max":
            return int(value)
    return None


def _int_or_none(text: str | None) -> int | None:
    return None if text is None else int(text)


@dataclass(frozen=True, slots=True)
class _Settled:
    """What changes only when someone changes it (a move to another cgroup, a new
    limit): read again every ``refresh_seconds``, not every pass."""

    read_at: float
    affinity: int | None
    paths: dict[str, str]
    quota: float | None
    limit: float | None


class LimitsCollector:
    """Reads the limits of one process: its cgroup's usage each pass, its affinity,
    cgroup and limits every ``refresh_seconds`` (each a few small files, times
    every level of the cgroup tree).

    The target's procfs, ``mounts_file`` and ``affinity`` are the data sources;
    tests pass their own."""

    def __init__(self, target: Target, *,
                 mounts_file: str | None = None,
                 affinity: Callable[[int], set[int]] = os.sched_getaffinity,
                 refresh_seconds: float = LIMITS_REFRESH_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pid = target.pid
        self._procfs = target.procfs
        self._mounts = _Mounts.read(mounts_path() if mounts_file is None else mounts_file)
        self._affinity = affinity
        self._refresh_seconds = refresh_seconds
        self._clock = clock
        self._settled: _Settled | None = None

    def sample(self) -> LimitsSample:
        now = self._clock()
        settled = self._settled
        if settled is None or now - settled.read_at >= self._refresh_seconds:
            settled = self._settled = self._settle(now)
        usage, hits, stall = self._usage(settled.paths)
        limit = settled.limit
        return LimitsSample(
            affinity_cpus=settled.affinity, cpu_quota_cores=settled.quota,
            memory_limit_bytes=None if limit is None or math.isinf(limit) else int(limit),
            memory_usage_bytes=usage, memory_limit_hits=hits, memory_stall_ratio=stall)

    def _usage(self, paths: dict[str, str]) -> tuple[int | None, int | None, float | None]:
        usage = hits = None
        stall = None
        v2_path = paths.get("")
        if self._mounts.v2 is not None and v2_path is not None:
            leaf = _levels(self._mounts.v2, v2_path)[0]
            usage = _int_or_none(_read(f"{leaf}/memory.current"))
            hits = _events_max(_read(f"{leaf}/memory.events"))
            stall = _psi_some_avg10(_read(f"{leaf}/memory.pressure"))
        memory_mount, memory_path = self._mounts.v1.get("memory"), paths.get("memory")
        if memory_mount is not None and memory_path is not None and usage is None:
            leaf = _levels(memory_mount, memory_path)[0]
            usage = _int_or_none(_read(f"{leaf}/memory.usage_in_bytes"))
            hits = _int_or_none(_read(f"{leaf}/memory.failcnt"))
        return usage, hits, stall

    def _settle(self, now: float) -> _Settled:
        try:
            affinity: int | None = len(self._affinity(self.pid))
        except OSError:
            affinity = None
        paths = _cgroup_paths(self.pid, self._procfs)
        quota = limit = None
        v2_path = paths.get("")
        if self._mounts.v2 is not None and v2_path is not None:
            levels = _levels(self._mounts.v2, v2_path)
            quota = _tightest([_v2_cpu_max(_read(f"{d}/cpu.max")) for d in levels])
            limit = _tightest([_v2_memory_max(_read(f"{d}/memory.max")) for d in levels])
        memory_mount, memory_path = self._mounts.v1.get("memory"), paths.get("memory")
        if memory_mount is not None and memory_path is not None:
            levels = _levels(memory_mount, memory_path)
            limit = _tightest([limit, *(_v1_memory_limit(d) for d in levels)])
        cpu_mount, cpu_path = self._mounts.v1.get("cpu"), paths.get("cpu")
        if cpu_mount is not None and cpu_path is not None:
            quota = _tightest([quota, *(_v1_cpu_quota(d) for d in _levels(cpu_mount, cpu_path))])
        return _Settled(now, affinity, paths, quota, limit)
