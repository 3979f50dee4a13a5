"""Typed GPU samples, shared by the NVML collector and the exporter."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuDeviceSample:
    """One device, one read. ``None`` means NVML does not support the field here."""

    index: int
    uuid: str
    name: str
    up: bool  # False once NVML reports the GPU lost; every reading below is then None
    utilization_ratio: float | None = None  # kernel-active time share, 0..1
    memory_utilization_ratio: float | None = None  # memory-controller busy share, 0..1
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    pcie_tx_bytes_per_second: float | None = None
    pcie_rx_bytes_per_second: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    energy_joules: float | None = None  # since the driver was loaded
    temperature_celsius: float | None = None
    sm_clock_hertz: float | None = None
    memory_clock_hertz: float | None = None
    # Every throttle reason NVML knows for the device, with whether it is active.
    throttle_reasons: tuple[tuple[str, bool], ...] | None = None


@dataclass(frozen=True, slots=True)
class GpuProcessSample:
    """One process on one device."""

    pid: int
    gpu_index: int
    uuid: str
    memory_bytes: int | None = None
    sm_utilization_ratio: float | None = None
    memory_utilization_ratio: float | None = None


@dataclass(frozen=True, slots=True)
class GpuSample:
    available: bool  # NVML loaded and at least one device found
    driver_version: str | None = None
    devices: tuple[GpuDeviceSample, ...] = ()
    processes: tuple[GpuProcessSample, ...] = ()
    # Every pid with a context on any GPU, read or not: how the daemon finds jobs.
    resident_pids: frozenset[int] = frozenset()
