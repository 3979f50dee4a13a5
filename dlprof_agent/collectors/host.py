"""Host-wide CPU, memory and load. Kept small: node_exporter covers the rest."""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

from dlprof_agent.collectors.procfs import (
    PROC_ROOT,
    read_cpu_times,
    read_meminfo,
    read_swap_pages,
)

# psutil counts swapped pages as 4 KiB, whatever the page size.
_SWAP_PAGE_BYTES = 4096

# Guest time is already part of user and nice; exporting it as a mode would
# make sum(modes) exceed the CPU time there is.
_COUNTED_IN_USER = frozenset({"guest", "guest_nice"})


@dataclass(frozen=True, slots=True)
class HostSample:
    cpu_seconds: tuple[tuple[str, float], ...]  # (mode, seconds summed over all CPUs)
    logical_cpus: int
    physical_cpus: int | None  # None where the platform does not tell
    memory_total_bytes: int
    memory_available_bytes: int
    swap_total_bytes: int
    swap_used_bytes: int
    swap_in_bytes: int  # cumulative, since boot
    swap_out_bytes: int
    load_average: tuple[float, float, float]  # 1, 5 and 15 minutes


class HostCollector:
    """Reads procfs (``procfs``), with psutil's values for the same fields; tests may
    pass a stand-in for the psutil module as ``source`` instead."""

    def __init__(self, *, source: ModuleType | None = None, procfs: str = PROC_ROOT) -> None:
        self._source = source
        self._procfs = procfs
        # Core counts do not change under a running job; read them once.
        counts = source if source is not None else _psutil()
        self._logical_cpus = counts.cpu_count(logical=True) or 1
        self._physical_cpus = counts.cpu_count(logical=False)

    def sample(self) -> HostSample:
        if self._source is None:
            return self._from_procfs()
        cpu = self._source.cpu_times()
        memory = self._source.virtual_memory()
        swap = self._source.swap_memory()
        load = self._source.getloadavg() if hasattr(self._source, "getloadavg") else os.getloadavg()
        return HostSample(
            cpu_seconds=tuple((mode, float(getattr(cpu, mode))) for mode in cpu._fields
                              if mode not in _COUNTED_IN_USER),
            logical_cpus=self._logical_cpus,
            physical_cpus=self._physical_cpus,
            memory_total_bytes=memory.total,
            memory_available_bytes=memory.available,
            swap_total_bytes=swap.total,
            swap_used_bytes=swap.used,
            swap_in_bytes=swap.sin,
            swap_out_bytes=swap.sout,
            load_average=(float(load[0]), float(load[1]), float(load[2])),
        )

    def _from_procfs(self) -> HostSample:
        memory = read_meminfo(root=self._procfs)
        total = memory["MemTotal"]
        available = memory.get("MemAvailable", 0)
        if available <= 0 or available > total:
            # psutil's own estimate, for kernels without a usable MemAvailable.
            available = _psutil().virtual_memory().available
        swap = read_swap_pages(root=self._procfs) or (0, 0)
        swap_total, swap_free = memory.get("SwapTotal", 0), memory.get("SwapFree", 0)
        load = os.getloadavg()
        return HostSample(
            cpu_seconds=tuple((mode, seconds) for mode, seconds in
                              read_cpu_times(root=self._procfs)
                              if mode not in _COUNTED_IN_USER),
            logical_cpus=self._logical_cpus,
            physical_cpus=self._physical_cpus,
            memory_total_bytes=total,
            memory_available_bytes=available,
            swap_total_bytes=swap_total,
            swap_used_bytes=swap_total - swap_free,
            swap_in_bytes=swap[0] * _SWAP_PAGE_BYTES,
            swap_out_bytes=swap[1] * _SWAP_PAGE_BYTES,
            load_average=(float(load[0]), float(load[1]), float(load[2])),
        )


def _psutil() -> ModuleType:
    import psutil  # only for what procfs does not say plainly: the core counts

    return psutil
