"""A stand-in for the ``pynvml`` module: the subset dlprof_agent.collectors.nvml uses.

Names, constants, raw units (mW, KB/s, MHz, mJ, %) and the exception hierarchy
follow pynvml, so ``Nvml(lib=FakeNvml(...))`` runs the real code path.
``test_gpu_collector`` checks that every function the collector calls here also
exists in the installed pynvml.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Error codes, as in pynvml.
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_UNKNOWN = 999


class NVMLError(Exception):
    """Like pynvml's: ``value`` is the NVML error code."""

    value: int = NVML_ERROR_UNKNOWN

    def __init__(self, value: int | None = None) -> None:
        if value is not None:
            self.value = value
        super().__init__(self.value)

    def __str__(self) -> str:
        return f"fake NVML error {self.value}"


class NVMLError_Uninitialized(NVMLError):  # pynvml's class names
    value = NVML_ERROR_UNINITIALIZED


class NVMLError_NotSupported(NVMLError):
    value = NVML_ERROR_NOT_SUPPORTED

    def __str__(self) -> str:
        return "Not Supported"


class NVMLError_NoPermission(NVMLError):
    value = NVML_ERROR_NO_PERMISSION


class NVMLError_NotFound(NVMLError):
    value = NVML_ERROR_NOT_FOUND


class NVMLError_DriverNotLoaded(NVMLError):
    value = NVML_ERROR_DRIVER_NOT_LOADED


class NVMLError_Timeout(NVMLError):
    value = NVML_ERROR_TIMEOUT


class NVMLError_LibraryNotFound(NVMLError):
    value = NVML_ERROR_LIBRARY_NOT_FOUND


class NVMLError_FunctionNotFound(NVMLError):
    value = NVML_ERROR_FUNCTION_NOT_FOUND


class NVMLError_GpuIsLost(NVMLError):
    value = NVML_ERROR_GPU_IS_LOST

    def __str__(self) -> str:
        return "GPU is lost"


class NVMLError_LibRmVersionMismatch(NVMLError):
    value = NVML_ERROR_LIB_RM_VERSION_MISMATCH


class NVMLError_Unknown(NVMLError):
    value = NVML_ERROR_UNKNOWN


# For annotations inside FakeNvml, whose attribute NVMLError shadows the class.
_Error = NVMLError


class NVMLLibraryMismatchError(Exception):
    """pynvml's error for an unversioned function the driver lacks (not an NVMLError)."""


@dataclass
class Utilization:  # c_nvmlUtilization_t
    gpu: int  # %
    memory: int  # %


@dataclass
class Memory:  # c_nvmlMemory_t
    total: int  # B
    free: int
    used: int


@dataclass
class ProcessInfo:  # what nvmlDeviceGet*RunningProcesses returns
    pid: int
    usedGpuMemory: int | None  # B; None when the driver cannot tell


@dataclass
class UtilSample:  # c_nvmlProcessUtilizationSample_t
    pid: int
    timeStamp: int  # µs
    smUtil: int  # %
    memUtil: int  # %
    encUtil: int = 0
    decUtil: int = 0


@dataclass
class FakeDevice:
    """One GPU, in NVML's raw units. The device object is also its handle."""

    name: str = "NVIDIA H200"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    gpu_util_percent: int = 50
    memory_util_percent: int = 25
    memory_used: int = 2 * 1024**3
    memory_total: int = 141 * 1024**3
    pcie_tx_kb_per_s: int = 1000
    pcie_rx_kb_per_s: int = 2000
    power_mw: int = 250_000
    power_limit_mw: int = 700_000
    energy_mj: int = 123_456_789
    temperature_c: int = 45
    sm_clock_mhz: int = 1980
    memory_clock_mhz: int = 2619
    throttle_mask: int = 0
    compute_processes: list[ProcessInfo] = field(default_factory=list)
    graphics_processes: list[ProcessInfo] = field(default_factory=list)
    util_samples: list[UtilSample] = field(default_factory=list)
    # Function names that raise NVMLError_NotSupported on this device.
    not_supported: set[str] = field(default_factory=set)
    # Function name -> exception class raised on each call.
    errors: dict[str, type[NVMLError]] = field(default_factory=dict)
    lost: bool = False  # every call on the device raises NVMLError_GpuIsLost
    # Every lastSeenTimeStamp nvmlDeviceGetProcessUtilization was called with.
    util_timestamps_asked: list[int] = field(default_factory=list)


class FakeNvml:
    """Module-like object with pynvml's API over a list of FakeDevice.

    ``clocks_event_api=False`` imitates a pynvml from before the "clocks event"
    rename (only the *Throttle* names). ``running_processes_mismatch`` makes the
    unversioned running-process calls fail as with a pre-R510 driver.
    """

    NVML_SUCCESS = NVML_SUCCESS
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2

    nvmlClocksThrottleReasonGpuIdle = 0x1
    nvmlClocksThrottleReasonApplicationsClocksSetting = 0x2
    nvmlClocksThrottleReasonSwPowerCap = 0x4
    nvmlClocksThrottleReasonHwSlowdown = 0x8
    nvmlClocksThrottleReasonSyncBoost = 0x10
    nvmlClocksThrottleReasonSwThermalSlowdown = 0x20
    nvmlClocksThrottleReasonHwThermalSlowdown = 0x40
    nvmlClocksThrottleReasonHwPowerBrakeSlowdown = 0x80
    nvmlClocksThrottleReasonDisplayClockSetting = 0x100
    nvmlClocksThrottleReasonBoardLimit = 0x200
    nvmlClocksThrottleReasonReliability = 0x400

    NVMLError = NVMLError
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NoPermission = NVMLError_NoPermission
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_Timeout = NVMLError_Timeout
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_LibRmVersionMismatch = NVMLError_LibRmVersionMismatch
    NVMLError_Unknown = NVMLError_Unknown
    NVMLLibraryMismatchError = NVMLLibraryMismatchError

    def __init__(self, devices: list[FakeDevice] | None = None, *,
                 init_error: type[_Error] | None = None,
                 driver_version: str = "560.35.03",
                 clocks_event_api: bool = True,
                 running_processes_mismatch: bool = False) -> None:
        self.devices = [FakeDevice()] if devices is None else devices
        self.init_error = init_error
        self.driver_version = driver_version
        self.running_processes_mismatch = running_processes_mismatch
        self.initialized = False
        self.init_calls = 0
        self.shutdown_calls = 0
        self.calls: list[str] = []  # every pynvml function called, in order
        if clocks_event_api:
            # Newer pynvml has both names; the constants share the same bits.
            self.nvmlDeviceGetCurrentClocksEventReasons = self._current_reasons
            for name in dir(self):
                if name.startswith("nvmlClocksThrottleReason") and not name.endswith(
                        ("BoardLimit", "Reliability")):  # as in pynvml 12/13
                    event_name = name.replace("Throttle", "Event")
                    setattr(self, event_name, getattr(self, name))

    # -- library -----------------------------------------------------------

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error()
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")
        self.shutdown_calls += 1
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check(None, "nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._check(None, "nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        device = self.devices[index]
        self._check(device, "nvmlDeviceGetHandleByIndex")
        return device

    # -- device ------------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: FakeDevice) -> str:
        self._check(handle, "nvmlDeviceGetUUID")
        return handle.uuid

    def nvmlDeviceGetName(self, handle: FakeDevice) -> str:
        self._check(handle, "nvmlDeviceGetName")
        return handle.name

    def nvmlDeviceGetUtilizationRates(self, handle: FakeDevice) -> Utilization:
        self._check(handle, "nvmlDeviceGetUtilizationRates")
        return Utilization(handle.gpu_util_percent, handle.memory_util_percent)

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice) -> Memory:
        self._check(handle, "nvmlDeviceGetMemoryInfo")
        return Memory(handle.memory_total, handle.memory_total - handle.memory_used,
                      handle.memory_used)

    def nvmlDeviceGetPcieThroughput(self, handle: FakeDevice, counter: int) -> int:
        self._check(handle, "nvmlDeviceGetPcieThroughput")
        if counter == self.NVML_PCIE_UTIL_TX_BYTES:
            return handle.pcie_tx_kb_per_s
        if counter == self.NVML_PCIE_UTIL_RX_BYTES:
            return handle.pcie_rx_kb_per_s
        raise NVMLError(2)  # invalid argument

    def nvmlDeviceGetPowerUsage(self, handle: FakeDevice) -> int:
        self._check(handle, "nvmlDeviceGetPowerUsage")
        return handle.power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeDevice) -> int:
        self._check(handle, "nvmlDeviceGetEnforcedPowerLimit")
        return handle.power_limit_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeDevice) -> int:
        self._check(handle, "nvmlDeviceGetTotalEnergyConsumption")
        return handle.energy_mj

    def nvmlDeviceGetTemperature(self, handle: FakeDevice, sensor: int) -> int:
        self._check(handle, "nvmlDeviceGetTemperature")
        if sensor != self.NVML_TEMPERATURE_GPU:
            raise NVMLError(2)
        return handle.temperature_c

    def nvmlDeviceGetClockInfo(self, handle: FakeDevice, clock: int) -> int:
        self._check(handle, "nvmlDeviceGetClockInfo")
        if clock == self.NVML_CLOCK_SM:
            return handle.sm_clock_mhz
        if clock == self.NVML_CLOCK_MEM:
            return handle.memory_clock_mhz
        raise NVMLError(2)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeDevice) -> int:
        self._check(handle, "nvmlDeviceGetCurrentClocksThrottleReasons")
        return handle.throttle_mask

    def _current_reasons(self, handle: FakeDevice) -> int:
        self._check(handle, "nvmlDeviceGetCurrentClocksEventReasons")
        return handle.throttle_mask

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[ProcessInfo]:
        if self.running_processes_mismatch:
            raise NVMLLibraryMismatchError("use nvmlDeviceGetComputeRunningProcesses_v2")
        self._check(handle, "nvmlDeviceGetComputeRunningProcesses")
        return list(handle.compute_processes)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: FakeDevice) -> list[ProcessInfo]:
        self._check(handle, "nvmlDeviceGetComputeRunningProcesses_v2")
        return list(handle.compute_processes)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeDevice) -> list[ProcessInfo]:
        if self.running_processes_mismatch:
            raise NVMLLibraryMismatchError("use nvmlDeviceGetGraphicsRunningProcesses_v2")
        self._check(handle, "nvmlDeviceGetGraphicsRunningProcesses")
        return list(handle.graphics_processes)

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: FakeDevice) -> list[ProcessInfo]:
        self._check(handle, "nvmlDeviceGetGraphicsRunningProcesses_v2")
        return list(handle.graphics_processes)

    def nvmlDeviceGetProcessUtilization(self, handle: FakeDevice,
                                        timeStamp: int) -> list[UtilSample]:
        self._check(handle, "nvmlDeviceGetProcessUtilization")
        handle.util_timestamps_asked.append(timeStamp)
        newer = [s for s in handle.util_samples if s.timeStamp > timeStamp]
        if not newer:
            raise NVMLError_NotFound()  # NVML's answer when no sample is newer
        return newer

    # -- helpers -----------------------------------------------------------

    def _check(self, device: FakeDevice | None, function: str) -> None:
        self.calls.append(function)
        if not self.initialized:
            raise NVMLError_Uninitialized()
        if device is None:
            return
        if device.lost:
            raise NVMLError_GpuIsLost()
        if function in device.not_supported:
            raise NVMLError_NotSupported()
        error = device.errors.get(function)
        if error is not None:
            raise error()
