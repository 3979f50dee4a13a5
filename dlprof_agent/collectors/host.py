"""Host-wide CPU, memory and load. Kept small: node_exporter covers the rest."""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import psutil

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
    """``source`` is the psutil module in production; tests pass a stand-in."""

    def __init__(self, *, source: ModuleType = psutil) -> None:
        self._source = source
        # Core counts do not change under a running job; read them once.
        self._logical_cpus = source.cpu_count(logical=True) or 1
        self._physical_cpus = source.cpu_count(logical=False)

    def sample(self) -> HostSample:
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
