"""The one module that talks to NVML (``pynvml``, from the nvidia-ml-py package).

Everything GPU-related in the project goes through :class:`Nvml`, so tests can
hand it a fake library with the same API. ``pynvml`` is imported and NVML is
started on first use only: importing this module, or ``dlprof-agent --help``,
never touches the driver.

Getters return base units (bytes, watts, joules, hertz, 0..1 ratios). A field
that NVML does not support on a device comes back as ``None``; a lost GPU
raises :class:`GpuLost`; any other NVML failure raises :class:`NvmlError`.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import threading
from typing import Any, NamedTuple

from dlprof_agent.errors import GpuLost, NvmlError, NvmlUnavailable

# NVML's device handle (a ctypes pointer in pynvml); only ever passed back to it.
DeviceHandle = object

INSTALL_HINT = "pip install 'dlprof-agent[gpu]'"

# Throttle ("clocks event") reasons: our snake_case name and the suffix of the
# library constant, nvmlClocksEventReason<Suffix> or nvmlClocksThrottleReason<Suffix>.
_THROTTLE_REASONS: tuple[tuple[str, str], ...] = (
    ("gpu_idle", "GpuIdle"),
    ("applications_clocks_setting", "ApplicationsClocksSetting"),
    ("sw_power_cap", "SwPowerCap"),
    ("hw_slowdown", "HwSlowdown"),
    ("sync_boost", "SyncBoost"),
    ("sw_thermal_slowdown", "SwThermalSlowdown"),
    ("hw_thermal_slowdown", "HwThermalSlowdown"),
    ("hw_power_brake_slowdown", "HwPowerBrakeSlowdown"),
    ("display_clock_setting", "DisplayClockSetting"),
    # Only in newer libraries (Hopper and later report them); skipped when absent.
    ("board_limit", "BoardLimit"),
    ("reliability", "Reliability"),
)
# Newer pynvml renamed "throttle" to "clocks event"; the old names are deprecated.
_THROTTLE_FUNCTIONS = (
    ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlClocksEventReason"),
    ("nvmlDeviceGetCurrentClocksThrottleReasons", "nvmlClocksThrottleReason"),
)


class Utilization(NamedTuple):
    gpu_ratio: float  # share of the last sample period with a kernel running, 0..1
    memory_ratio: float  # share of it with device memory being read or written, 0..1


class MemoryInfo(NamedTuple):
    used_bytes: int
    total_bytes: int


class ProcessMemory(NamedTuple):
    pid: int
    used_bytes: int | None  # None where the driver cannot tell (e.g. Windows WDDM)


class ProcessUtilization(NamedTuple):
    pid: int
    timestamp_us: int  # NVML's CPU timestamp of the sample, in microseconds
    sm_ratio: float  # 0..1
    memory_ratio: float  # 0..1


def _import_pynvml() -> Any:
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise NvmlUnavailable(f"nvidia-ml-py is not installed: {INSTALL_HINT}") from exc


def _init_failure_reason(lib: Any, exc: BaseException) -> str:
    """One line saying why nvmlInit failed and what the user can do about it."""
    reasons: tuple[tuple[str, str], ...] = (
        ("NVMLError_LibraryNotFound",
         "NVML library not found (libnvidia-ml.so.1): no NVIDIA driver on this machine"),
        ("NVMLError_DriverNotLoaded",
         "the NVIDIA kernel driver is not loaded: check that nvidia-smi works"),
        ("NVMLError_NoPermission",
         "no permission to use NVML: run as a user that can open /dev/nvidia*"),
        ("NVMLError_LibRmVersionMismatch",
         "NVML and the loaded NVIDIA driver differ in version: reload the driver or reboot"),
    )
    for class_name, reason in reasons:
        cls = getattr(lib, class_name, None)
        if isinstance(cls, type) and isinstance(exc, cls):
            return reason
    return f"NVML failed to start ({exc}): check that nvidia-smi works"


class _NeverRaised(Exception):
    """Stands in for an exception class the library does not have."""


def _text(value: object) -> str:
    # Old pynvml versions return bytes for strings.
    return value.decode() if isinstance(value, bytes) else str(value)


class Nvml:
    """Lazily started NVML: ``lib`` is the pynvml module or a fake with its API.

    NVML starts on the first call (under a lock) and shuts down at exit.
    """

    def __init__(self, *, lib: Any | None = None) -> None:
        self._lib = lib
        self._lock = threading.Lock()
        self._ready: Any | None = None  # the library, once nvmlInit succeeded

    # -- lifecycle ---------------------------------------------------------

    def init(self) -> None:
        """Start NVML if it is not running. Raises NvmlUnavailable."""
        self._started()

    def shutdown(self) -> None:
        """Stop NVML; a later call starts it again."""
        with self._lock:
            lib, self._ready = self._ready, None
            if lib is None:
                return
            atexit.unregister(self.shutdown)
            # Shutting down anyway: a failure here has nothing left to affect.
            with contextlib.suppress(lib.NVMLError):
                lib.nvmlShutdown()

    def _started(self) -> Any:
        lib = self._ready
        if lib is not None:
            return lib
        with self._lock:
            if self._ready is None:
                if self._lib is None:
                    self._lib = _import_pynvml()
                lib = self._lib
                try:
                    lib.nvmlInit()
                except lib.NVMLError as exc:
                    raise NvmlUnavailable(_init_failure_reason(lib, exc)) from exc
                self._ready = lib
                atexit.register(self.shutdown)
            return self._ready

    # -- the one place NVML errors are translated ------------------------------

    def _call(self, function: str, *args: object,
              optional: bool = True, no_data_ok: bool = False) -> Any:
        """``lib.<function>(*args)`` with NVML errors translated.

        ``optional``: "not supported" (also a function this driver or pynvml
        lacks) returns None, since such a field is absent, not failed.
        ``no_data_ok``: NVML's "not found" means "no samples yet" and returns None.
        """
        lib = self._started()
        fn = getattr(lib, function, None)
        if fn is None:
            if optional:
                return None
            raise NvmlError(function, "missing from this pynvml; upgrade nvidia-ml-py")
        try:
            return fn(*args)
        except lib.NVMLError as exc:
            code = getattr(exc, "value", None)
            if isinstance(exc, lib.NVMLError_GpuIsLost):
                raise GpuLost(function, str(exc), code) from exc
            unsupported = (lib.NVMLError_NotSupported, lib.NVMLError_FunctionNotFound)
            if optional and isinstance(exc, unsupported):
                return None
            # pynvml raises NVMLError(NVML_SUCCESS) when a sample query finds zero samples.
            if no_data_ok and (isinstance(exc, lib.NVMLError_NotFound)
                               or code == getattr(lib, "NVML_SUCCESS", 0)):
                return None
            raise NvmlError(function, str(exc), code) from exc

    # -- system and static facts -------------------------------------------

    def device_count(self) -> int:
        return int(self._call("nvmlDeviceGetCount", optional=False))

    def device_handle(self, index: int) -> DeviceHandle:
        handle: DeviceHandle = self._call("nvmlDeviceGetHandleByIndex", index, optional=False)
        return handle

    def driver_version(self) -> str:
        return _text(self._call("nvmlSystemGetDriverVersion", optional=False))

    def uuid(self, handle: DeviceHandle) -> str:
        # "GPU-" followed by a UUID; stable across reboots, unlike the index.
        return _text(self._call("nvmlDeviceGetUUID", handle, optional=False))

    def name(self, handle: DeviceHandle) -> str:
        return _text(self._call("nvmlDeviceGetName", handle, optional=False))

    # -- readings ----------------------------------------------------------

    def utilization(self, handle: DeviceHandle) -> Utilization | None:
        raw = self._call("nvmlDeviceGetUtilizationRates", handle)
        if raw is None:
            return None
        # in percent (%) over the driver's last sample period
        return Utilization(int(raw.gpu) / 100, int(raw.memory) / 100)

    def memory_info(self, handle: DeviceHandle) -> MemoryInfo | None:
        raw = self._call("nvmlDeviceGetMemoryInfo", handle)
        if raw is None:
            return None
        # in bytes (B)
        return MemoryInfo(int(raw.used), int(raw.total))

    def pcie_tx_bytes_per_second(self, handle: DeviceHandle) -> float | None:
        lib = self._started()
        return self._pcie(handle, lib.NVML_PCIE_UTIL_TX_BYTES)

    def pcie_rx_bytes_per_second(self, handle: DeviceHandle) -> float | None:
        lib = self._started()
        return self._pcie(handle, lib.NVML_PCIE_UTIL_RX_BYTES)

    def _pcie(self, handle: DeviceHandle, counter: int) -> float | None:
        raw = self._call("nvmlDeviceGetPcieThroughput", handle, counter)
        # in kilobytes per second (KB/s) over a 20 ms window
        return None if raw is None else float(raw) * 1024

    def power_watts(self, handle: DeviceHandle) -> float | None:
        raw = self._call("nvmlDeviceGetPowerUsage", handle)
        # in milliwatts (mW)
        return None if raw is None else float(raw) / 1000

    def power_limit_watts(self, handle: DeviceHandle) -> float | None:
        raw = self._call("nvmlDeviceGetEnforcedPowerLimit", handle)
        # in milliwatts (mW)
        return None if raw is None else float(raw) / 1000

    def energy_joules(self, handle: DeviceHandle) -> float | None:
        raw = self._call("nvmlDeviceGetTotalEnergyConsumption", handle)
        # in millijoules (mJ) since the driver was loaded; Volta and later
        return None if raw is None else float(raw) / 1000

    def temperature_celsius(self, handle: DeviceHandle) -> float | None:
        lib = self._started()
        raw = self._call("nvmlDeviceGetTemperature", handle, lib.NVML_TEMPERATURE_GPU)
        # in degrees Celsius (°C), the GPU die sensor
        return None if raw is None else float(raw)

    def sm_clock_hertz(self, handle: DeviceHandle) -> float | None:
        lib = self._started()
        return self._clock(handle, lib.NVML_CLOCK_SM)

    def memory_clock_hertz(self, handle: DeviceHandle) -> float | None:
        lib = self._started()
        return self._clock(handle, lib.NVML_CLOCK_MEM)

    def _clock(self, handle: DeviceHandle, clock: int) -> float | None:
        raw = self._call("nvmlDeviceGetClockInfo", handle, clock)
        # in megahertz (MHz), the current clock
        return None if raw is None else float(raw) * 1e6

    def throttle_reasons(self, handle: DeviceHandle) -> tuple[tuple[str, bool], ...] | None:
        """Each reason this library knows, with whether it holds the clocks down now."""
        lib = self._started()
        for function, prefix in _THROTTLE_FUNCTIONS:
            if not hasattr(lib, function):
                continue
            mask = self._call(function, handle)  # bitmask of the reason constants
            if mask is None:
                continue  # an old driver may lack the new name but have the old one
            reasons: list[tuple[str, bool]] = []
            for name, suffix in _THROTTLE_REASONS:
                bit = getattr(lib, prefix + suffix, None)
                if bit is None:  # some reasons exist only under the older prefix
                    bit = getattr(lib, "nvmlClocksThrottleReason" + suffix, None)
                if bit is not None:
                    reasons.append((name, bool(int(mask) & int(bit))))
            return tuple(reasons)
        return None

    # -- processes ---------------------------------------------------------

    def running_processes(self, handle: DeviceHandle) -> tuple[ProcessMemory, ...]:
        """Compute and graphics processes with a context on the device, one per pid."""
        memory: dict[int, int | None] = {}
        for function in ("nvmlDeviceGetComputeRunningProcesses",
                         "nvmlDeviceGetGraphicsRunningProcesses"):
            for proc in self._processes(function, handle):
                pid = int(proc.pid)
                used = None if proc.usedGpuMemory is None else int(proc.usedGpuMemory)  # bytes
                # A process in both lists has one allocation total; don't add it twice.
                known = memory.get(pid)
                memory[pid] = used if known is None else max(known, used or 0)
        return tuple(ProcessMemory(pid, used) for pid, used in memory.items())

    def _processes(self, function: str, handle: DeviceHandle) -> list[Any]:
        lib = self._started()
        mismatch = getattr(lib, "NVMLLibraryMismatchError", None)
        if not (isinstance(mismatch, type) and issubclass(mismatch, Exception)):
            mismatch = _NeverRaised
        try:
            procs = self._call(function, handle)
        except mismatch:
            # pynvml's unversioned call wants the _v3 C function; drivers before
            # R510 only have _v2, and pynvml says so with its own exception.
            procs = self._call(function + "_v2", handle)
        return [] if procs is None else list(procs)

    def process_utilization(self, handle: DeviceHandle,
                            last_seen_us: int) -> tuple[ProcessUtilization, ...]:
        """Samples newer than ``last_seen_us`` (0: all the driver still holds)."""
        raw = self._call("nvmlDeviceGetProcessUtilization", handle, last_seen_us,
                         no_data_ok=True)
        if raw is None:
            return ()
        # smUtil and memUtil in percent (%); timeStamp in microseconds (µs)
        return tuple(
            ProcessUtilization(int(s.pid), int(s.timeStamp), int(s.smUtil) / 100,
                               int(s.memUtil) / 100)
            for s in raw
        )
