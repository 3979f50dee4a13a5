"""GPU collector: one NVML read per device per interval, into a :class:`GpuSample`.

It never raises for NVML trouble. Without a usable NVML (no nvidia-ml-py, no
driver, no GPU) every sample is ``GpuSample(available=False)`` and one info
line says why. A lost GPU is reported ``up=False`` and counted as a failure;
the other GPUs are still read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from dlprof_agent.collectors.error_log import ErrorLog
from dlprof_agent.collectors.gpu_samples import GpuDeviceSample, GpuProcessSample, GpuSample
from dlprof_agent.collectors.nvml import DeviceHandle, Nvml, ProcessUtilization
from dlprof_agent.errors import GpuLost, NvmlError, NvmlUnavailable

log = logging.getLogger("dlprof_agent")

NAME = "gpu"  # the collector label on dlprof_collector_errors_total

T = TypeVar("T")


@dataclass
class _Device:
    index: int
    handle: DeviceHandle | None  # None: the GPU was already lost when NVML started
    uuid: str  # "" when unknown (lost before it could be read)
    name: str
    # Newest process-utilization timestamp seen (NVML's µs clock). Passing it
    # back asks NVML for newer samples only, so a reading never lags an interval.
    last_seen_us: int = 0


class GpuCollector:
    """Reads every GPU NVML sees, plus the processes in ``pids`` on them.

    ``nvml`` is the seam for tests; by default the real pynvml, started on the
    first sample. If NVML is unusable it is tried again every ``retry_seconds``
    (a driver may be loaded after the agent starts), silently after the first.
    """

    def __init__(self, *, nvml: Nvml | None = None, errors: ErrorLog,
                 retry_seconds: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._nvml = nvml if nvml is not None else Nvml()
        self._errors = errors
        self._retry_seconds = retry_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._devices: tuple[_Device, ...] | None = None  # set once NVML is up
        self._driver_version: str | None = None
        self._next_attempt = float("-inf")
        self._said_off = False

    def sample(self, pids: frozenset[int]) -> GpuSample:
        with self._lock:
            devices = self._setup()
            if not devices:
                return GpuSample(available=False)
            device_samples: list[GpuDeviceSample] = []
            process_samples: list[GpuProcessSample] = []
            resident: set[int] = set()
            for device in devices:
                reading, processes = self._read(device, pids, resident)
                device_samples.append(reading)
                process_samples.extend(processes)
            return GpuSample(available=True, driver_version=self._driver_version,
                             devices=tuple(device_samples), processes=tuple(process_samples),
                             resident_pids=frozenset(resident))

    # -- setup -------------------------------------------------------------

    def _setup(self) -> tuple[_Device, ...]:
        """The devices, starting NVML if due; () while GPU metrics are off."""
        if self._devices is not None:
            return self._devices
        now = self._clock()
        if now < self._next_attempt:
            return ()
        try:
            self._nvml.init()
            count = self._nvml.device_count()
            driver_version = self._nvml.driver_version()
            devices = tuple(self._open(index) for index in range(count))
        except NvmlUnavailable as exc:
            self._off(now, exc.reason)  # an environment fact, not a failure
            return ()
        except NvmlError as exc:
            self._errors.record(NAME, exc)
            self._off(now, f"NVML failed while listing GPUs ({exc})")
            return ()
        if not devices:
            self._off(now, "NVML found no NVIDIA GPU on this machine")
            return ()
        self._devices, self._driver_version = devices, driver_version
        log.info("GPU metrics on: %d GPU(s), NVIDIA driver %s", len(devices), driver_version)
        return devices

    def _open(self, index: int) -> _Device:
        try:
            handle = self._nvml.device_handle(index)
            return _Device(index, handle, self._nvml.uuid(handle), self._nvml.name(handle))
        except GpuLost:
            return _Device(index, None, "", "")  # reported down on every sample

    def _off(self, now: float, reason: str) -> None:
        self._next_attempt = now + self._retry_seconds
        if not self._said_off:
            self._said_off = True
            log.info("GPU metrics are off: %s", reason)

    # -- one device --------------------------------------------------------

    def _read(self, device: _Device, pids: frozenset[int], resident: set[int]
              ) -> tuple[GpuDeviceSample, list[GpuProcessSample]]:
        try:
            if device.handle is None:
                raise GpuLost("nvmlDeviceGetHandleByIndex", "GPU is lost")
            return self._read_up(device, device.handle, pids, resident)
        except GpuLost as exc:
            which = f"GPU {device.index} {device.uuid}".rstrip()
            self._errors.record(NAME, f"{which} is lost ({exc})")
            return GpuDeviceSample(device.index, device.uuid, device.name, up=False), []

    def _read_up(self, device: _Device, handle: DeviceHandle, pids: frozenset[int],
                 resident: set[int]) -> tuple[GpuDeviceSample, list[GpuProcessSample]]:
        nvml = self._nvml

        def field(getter: Callable[[DeviceHandle], T | None]) -> T | None:
            # A failed field is counted and left out; the rest of the read goes on.
            # GpuLost passes through: then the whole device is down.
            try:
                return getter(handle)
            except GpuLost:
                raise
            except NvmlError as exc:
                self._errors.record(NAME, f"GPU {device.index}: {exc}")
                return None

        utilization = field(nvml.utilization)
        memory = field(nvml.memory_info)
        reading = GpuDeviceSample(
            index=device.index,
            uuid=device.uuid,
            name=device.name,
            up=True,
            utilization_ratio=None if utilization is None else utilization.gpu_ratio,
            memory_utilization_ratio=None if utilization is None else utilization.memory_ratio,
            memory_used_bytes=None if memory is None else memory.used_bytes,
            memory_total_bytes=None if memory is None else memory.total_bytes,
            pcie_tx_bytes_per_second=field(nvml.pcie_tx_bytes_per_second),
            pcie_rx_bytes_per_second=field(nvml.pcie_rx_bytes_per_second),
            power_watts=field(nvml.power_watts),
            power_limit_watts=field(nvml.power_limit_watts),
            energy_joules=field(nvml.energy_joules),
            temperature_celsius=field(nvml.temperature_celsius),
            sm_clock_hertz=field(nvml.sm_clock_hertz),
            memory_clock_hertz=field(nvml.memory_clock_hertz),
            throttle_reasons=field(nvml.throttle_reasons),
        )

        running = field(nvml.running_processes) or ()
        resident.update(p.pid for p in running)
        memory_by_pid = {p.pid: p.used_bytes for p in running if p.pid in pids}
        samples = field(lambda h: nvml.process_utilization(h, device.last_seen_us)) or ()
        # Advance over every sample, ours or not: they are all older than the next call's.
        device.last_seen_us = max([device.last_seen_us, *(s.timestamp_us for s in samples)])
        # Utilization is the newest sample since the previous call, else None. We
        # don't carry an older value forward: it would show a process that has
        # gone quiet as still busy.
        newest: dict[int, ProcessUtilization] = {}
        for s in samples:
            seen = newest.get(s.pid)
            if s.pid in pids and (seen is None or s.timestamp_us > seen.timestamp_us):
                newest[s.pid] = s
        processes = []
        for pid in sorted(memory_by_pid.keys() | newest.keys()):
            util = newest.get(pid)
            processes.append(GpuProcessSample(
                pid=pid,
                gpu_index=device.index,
                uuid=device.uuid,
                memory_bytes=memory_by_pid.get(pid),
                sm_utilization_ratio=None if util is None else util.sm_ratio,
                memory_utilization_ratio=None if util is None else util.memory_ratio,
            ))
        return reading, processes
