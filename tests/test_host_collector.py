"""HostCollector reads the host from procfs, as psutil would, onto HostSample."""

from __future__ import annotations

import os
from types import ModuleType, SimpleNamespace
from typing import NamedTuple

from dlprof_agent.collectors.host import HostCollector


class scputimes(NamedTuple):  # psutil's own name for this record
    """The fields psutil.cpu_times() has on Linux, in its order."""

    user: float
    nice: float
    system: float
    idle: float
    iowait: float
    irq: float
    softirq: float
    steal: float
    guest: float
    guest_nice: float


GIB = 1 << 30


class FakePsutil(ModuleType):
    """Stands in for the psutil module; counts the calls it gets."""

    def __init__(self, *, logical: int | None = 16, physical: int | None = 8,
                 with_loadavg: bool = True) -> None:
        super().__init__("fake_psutil")
        self.cpu_count_calls = 0
        self._logical = logical
        self._physical = physical
        self.cpu = scputimes(user=100, nice=5, system=20.5, idle=500, iowait=3, irq=1,
                             softirq=2, steal=0.5, guest=40, guest_nice=4)
        if with_loadavg:
            self.getloadavg = lambda: (1.5, 2.0, 3)

    def cpu_count(self, logical: bool = True) -> int | None:
        self.cpu_count_calls += 1
        return self._logical if logical else self._physical

    def cpu_times(self) -> scputimes:
        return self.cpu

    def virtual_memory(self) -> SimpleNamespace:
        return SimpleNamespace(total=64 * GIB, available=40 * GIB, used=20 * GIB, percent=37.5)

    def swap_memory(self) -> SimpleNamespace:
        return SimpleNamespace(total=8 * GIB, used=1 * GIB, free=7 * GIB, percent=12.5,
                               sin=4096, sout=8192)


def test_readings_map_onto_the_sample() -> None:
    fake = FakePsutil()
    sample = HostCollector(source=fake).sample()

    assert sample.logical_cpus == 16
    assert sample.physical_cpus == 8
    assert sample.memory_total_bytes == 64 * GIB
    assert sample.memory_available_bytes == 40 * GIB
    assert sample.swap_total_bytes == 8 * GIB
    assert sample.swap_used_bytes == 1 * GIB
    assert sample.swap_in_bytes == 4096
    assert sample.swap_out_bytes == 8192
    assert sample.load_average == (1.5, 2.0, 3.0)
    assert all(isinstance(value, float) for value in sample.load_average)


def test_guest_time_is_left_out_because_user_and_nice_already_hold_it() -> None:
    sample = HostCollector(source=FakePsutil()).sample()

    assert sample.cpu_seconds == (
        ("user", 100.0), ("nice", 5.0), ("system", 20.5), ("idle", 500.0), ("iowait", 3.0),
        ("irq", 1.0), ("softirq", 2.0), ("steal", 0.5))
    assert all(isinstance(seconds, float) for _, seconds in sample.cpu_seconds)
    # Summing the modes gives the CPU time there was, not more.
    assert sum(seconds for _, seconds in sample.cpu_seconds) == 632.0


def test_core_counts_are_read_once_not_every_sample() -> None:
    fake = FakePsutil()
    collector = HostCollector(source=fake)
    calls = fake.cpu_count_calls
    collector.sample()
    collector.sample()
    assert fake.cpu_count_calls == calls


def test_unknown_core_counts() -> None:
    sample = HostCollector(source=FakePsutil(logical=None, physical=None)).sample()
    assert sample.logical_cpus == 1  # at least one CPU is running this
    assert sample.physical_cpus is None  # not exported rather than guessed


def test_a_source_without_getloadavg_falls_back_to_the_os() -> None:
    sample = HostCollector(source=FakePsutil(with_loadavg=False)).sample()
    assert len(sample.load_average) == 3
    assert all(load >= 0.0 for load in sample.load_average)


def test_real_psutil_values_are_sane() -> None:
    sample = HostCollector().sample()

    assert sample.logical_cpus == os.cpu_count()
    assert sample.physical_cpus is None or 1 <= sample.physical_cpus <= sample.logical_cpus
    modes = dict(sample.cpu_seconds)
    assert {"user", "system", "idle"} <= set(modes)
    assert not {"guest", "guest_nice"} & set(modes)
    assert all(seconds >= 0 for seconds in modes.values())
    assert 0 < sample.memory_available_bytes <= sample.memory_total_bytes
    assert 0 <= sample.swap_used_bytes <= sample.swap_total_bytes
    assert sample.swap_in_bytes >= 0 and sample.swap_out_bytes >= 0
    assert all(load >= 0 for load in sample.load_average)


def test_real_cpu_counters_do_not_go_backwards() -> None:
    collector = HostCollector()
    first = dict(collector.sample().cpu_seconds)
    second = dict(collector.sample().cpu_seconds)
    for mode, seconds in first.items():
        assert second[mode] >= seconds, mode


def test_procfs_readings_are_psutils() -> None:
    # The default reads procfs itself; psutil reading the same files must agree
    # on what does not move between two reads.
    import psutil

    sample = HostCollector().sample()
    from_psutil = HostCollector(source=psutil).sample()
    assert [mode for mode, _ in sample.cpu_seconds] == [
        mode for mode, _ in from_psutil.cpu_seconds]
    assert sample.memory_total_bytes == from_psutil.memory_total_bytes
    assert sample.swap_total_bytes == from_psutil.swap_total_bytes
    assert sample.swap_in_bytes <= from_psutil.swap_in_bytes
    assert sample.swap_out_bytes <= from_psutil.swap_out_bytes
    for (_, seconds), (_, later) in zip(sample.cpu_seconds, from_psutil.cpu_seconds,
                                        strict=True):
        assert seconds <= later
