"""GpuCollector and Nvml against a fake pynvml: units, absence, failures, processes."""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import fields

import pytest

from dlprof_agent.collectors.error_log import ErrorLog
from dlprof_agent.collectors.gpu import GpuCollector
from dlprof_agent.collectors.gpu_samples import GpuDeviceSample, GpuSample
from dlprof_agent.collectors.nvml import Nvml
from dlprof_agent.errors import NvmlUnavailable
from tests.fake_nvml import (
    FakeDevice,
    FakeNvml,
    NVMLError,
    NVMLError_DriverNotLoaded,
    NVMLError_LibraryNotFound,
    NVMLError_NoPermission,
    NVMLError_Unknown,
    ProcessInfo,
    UtilSample,
)

READINGS = [f.name for f in fields(GpuDeviceSample) if f.name not in ("index", "uuid", "name",
                                                                       "up")]


def collector(fake: FakeNvml, errors: ErrorLog | None = None,
              clock: list[float] | None = None) -> GpuCollector:
    now = clock if clock is not None else [0.0]
    return GpuCollector(nvml=Nvml(lib=fake), errors=errors or ErrorLog(),
                        clock=lambda: now[0])


def off_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "GPU metrics are off" in r.getMessage()]


# -- device readings ------------------------------------------------------------


def test_readings_are_converted_to_base_units() -> None:
    device = FakeDevice(gpu_util_percent=87, memory_util_percent=40,
                        memory_used=3 * 1024**3, memory_total=80 * 1024**3,
                        pcie_tx_kb_per_s=1500, pcie_rx_kb_per_s=250,
                        power_mw=312_500, power_limit_mw=700_000, energy_mj=4_200_500,
                        temperature_c=61, sm_clock_mhz=1980, memory_clock_mhz=2619)
    sample = collector(FakeNvml([device], driver_version="560.35.03")).sample(frozenset())

    assert sample.available
    assert sample.driver_version == "560.35.03"
    (d,) = sample.devices
    assert (d.index, d.uuid, d.name, d.up) == (0, device.uuid, "NVIDIA H200", True)
    assert d.utilization_ratio == pytest.approx(0.87)
    assert d.memory_utilization_ratio == pytest.approx(0.40)
    assert d.memory_used_bytes == 3 * 1024**3
    assert d.memory_total_bytes == 80 * 1024**3
    assert d.pcie_tx_bytes_per_second == pytest.approx(1500 * 1024)  # KB/s -> B/s
    assert d.pcie_rx_bytes_per_second == pytest.approx(250 * 1024)
    assert d.power_watts == pytest.approx(312.5)  # mW -> W
    assert d.power_limit_watts == pytest.approx(700.0)
    assert d.energy_joules == pytest.approx(4200.5)  # mJ -> J
    assert d.temperature_celsius == pytest.approx(61.0)
    assert d.sm_clock_hertz == pytest.approx(1.98e9)  # MHz -> Hz
    assert d.memory_clock_hertz == pytest.approx(2.619e9)


def test_unsupported_fields_are_none_not_nan_and_not_failures() -> None:
    device = FakeDevice(not_supported={
        "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetPcieThroughput", "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetTemperature", "nvmlDeviceGetClockInfo",
        "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons",
    })
    errors = ErrorLog()
    (d,) = collector(FakeNvml([device]), errors).sample(frozenset()).devices

    assert d.up
    for name in READINGS:
        value = getattr(d, name)
        assert value is None, name
        assert not (isinstance(value, float) and math.isnan(value))
    assert errors.counts() == {}


def test_a_failing_field_is_counted_and_left_out() -> None:
    device = FakeDevice(errors={"nvmlDeviceGetPowerUsage": NVMLError_Unknown})
    errors = ErrorLog()
    gpu = collector(FakeNvml([device]), errors)

    (d,) = gpu.sample(frozenset()).devices
    gpu.sample(frozenset())

    assert d.up
    assert d.power_watts is None
    assert d.power_limit_watts == pytest.approx(700.0)  # the rest is still read
    assert errors.counts() == {"gpu": 2}  # once per sample


def test_throttle_reasons_are_decoded() -> None:
    fake = FakeNvml([FakeDevice(throttle_mask=FakeNvml.nvmlClocksThrottleReasonSwPowerCap
                                | FakeNvml.nvmlClocksThrottleReasonHwThermalSlowdown)])
    (d,) = collector(fake).sample(frozenset()).devices

    assert d.throttle_reasons is not None
    reasons = dict(d.throttle_reasons)
    assert set(reasons) == {
        "gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown", "sync_boost",
        "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown",
        "display_clock_setting", "board_limit", "reliability",
    }
    assert {name for name, active in reasons.items() if active} == {
        "sw_power_cap", "hw_thermal_slowdown"}
    # The current name is preferred over the deprecated one.
    assert "nvmlDeviceGetCurrentClocksEventReasons" in fake.calls
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" not in fake.calls


def test_throttle_reasons_with_a_pynvml_from_before_the_rename() -> None:
    fake = FakeNvml([FakeDevice(throttle_mask=FakeNvml.nvmlClocksThrottleReasonGpuIdle)],
                    clocks_event_api=False)
    (d,) = collector(fake).sample(frozenset()).devices

    assert d.throttle_reasons is not None
    assert [name for name, active in d.throttle_reasons if active] == ["gpu_idle"]
    assert "nvmlDeviceGetCurrentClocksThrottleReasons" in fake.calls


# -- lost GPUs --------------------------------------------------------------------


def test_a_lost_gpu_is_down_and_the_others_are_still_read(
        caplog: pytest.LogCaptureFixture) -> None:
    lost = FakeDevice(uuid="GPU-aaaa", compute_processes=[ProcessInfo(10, 1024)])
    healthy = FakeDevice(uuid="GPU-bbbb", compute_processes=[ProcessInfo(10, 2048)])
    errors = ErrorLog()
    gpu = collector(FakeNvml([lost, healthy]), errors)
    assert all(d.up for d in gpu.sample(frozenset({10})).devices)

    lost.lost = True
    with caplog.at_level(logging.WARNING, logger="dlprof_agent"):
        first = gpu.sample(frozenset({10}))
        second = gpu.sample(frozenset({10}))

    for sample in (first, second):
        down, up = sample.devices
        assert (down.index, down.uuid, down.up) == (0, "GPU-aaaa", False)
        assert all(getattr(down, name) is None for name in READINGS)
        assert up.up
        assert up.power_watts == pytest.approx(250.0)
        assert [(p.gpu_index, p.memory_bytes) for p in sample.processes] == [(1, 2048)]
    assert errors.counts() == {"gpu": 2}
    assert len([r for r in caplog.records if "lost" in r.getMessage()]) == 1


def test_a_gpu_lost_before_nvml_started_is_reported_down() -> None:
    fake = FakeNvml([FakeDevice(lost=True), FakeDevice(uuid="GPU-bbbb")])
    errors = ErrorLog()
    sample = collector(fake, errors).sample(frozenset())

    assert sample.available
    assert [(d.index, d.up) for d in sample.devices] == [(0, False), (1, True)]
    assert sample.devices[1].uuid == "GPU-bbbb"
    assert errors.counts() == {"gpu": 1}


# -- no NVML ------------------------------------------------------------------------


@pytest.mark.parametrize(("error", "reason"), [
    (NVMLError_LibraryNotFound, "NVML library not found"),
    (NVMLError_DriverNotLoaded, "driver is not loaded"),
    (NVMLError_NoPermission, "no permission"),
    (NVMLError_Unknown, "NVML failed to start"),
])
def test_nvml_that_cannot_start_means_unavailable_logged_once(
        error: type[NVMLError], reason: str, caplog: pytest.LogCaptureFixture) -> None:
    errors = ErrorLog()
    clock = [0.0]
    gpu = collector(FakeNvml(init_error=error), errors, clock)

    with caplog.at_level(logging.INFO, logger="dlprof_agent"):
        samples = []
        for _ in range(3):
            samples.append(gpu.sample(frozenset({1})))
            clock[0] += 120  # past the retry interval: init is tried again, quietly

    assert samples == [GpuSample(available=False)] * 3
    (line,) = off_lines(caplog)
    assert reason in line
    assert errors.counts() == {}  # an environment fact, not a collector failure


def test_pynvml_not_installed_means_unavailable(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    gpu = GpuCollector(errors=ErrorLog())  # the production default: real pynvml

    with caplog.at_level(logging.INFO, logger="dlprof_agent"):
        assert gpu.sample(frozenset()) == GpuSample(available=False)
        assert gpu.sample(frozenset()) == GpuSample(available=False)

    (line,) = off_lines(caplog)
    assert "pip install 'dlprof-agent[gpu]'" in line
    with pytest.raises(NvmlUnavailable, match="nvidia-ml-py is not installed"):
        Nvml().init()


def test_no_gpus_means_unavailable(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="dlprof_agent"):
        sample = collector(FakeNvml([])).sample(frozenset())

    assert sample == GpuSample(available=False)
    (line,) = off_lines(caplog)
    assert "no NVIDIA GPU" in line


def test_init_is_retried_only_after_the_retry_interval() -> None:
    fake = FakeNvml(init_error=NVMLError_DriverNotLoaded)
    clock = [1000.0]
    gpu = collector(fake, clock=clock)

    assert not gpu.sample(frozenset()).available
    clock[0] += 30
    assert not gpu.sample(frozenset()).available
    assert fake.init_calls == 1

    fake.init_error = None  # the driver got loaded
    clock[0] += 31
    assert gpu.sample(frozenset()).available
    assert gpu.sample(frozenset()).available
    assert fake.init_calls == 2


def test_nothing_touches_nvml_before_the_first_sample() -> None:
    fake = FakeNvml()
    Nvml(lib=fake)
    collector(fake)
    assert fake.calls == []


def test_shutdown_stops_nvml_once() -> None:
    fake = FakeNvml()
    nvml = Nvml(lib=fake)
    nvml.shutdown()  # never started: nothing to do
    nvml.init()
    nvml.init()
    nvml.shutdown()
    nvml.shutdown()
    assert (fake.init_calls, fake.shutdown_calls) == (1, 1)


# -- processes --------------------------------------------------------------------


def test_only_requested_pids_are_reported() -> None:
    device = FakeDevice(
        compute_processes=[ProcessInfo(10, 100), ProcessInfo(11, None), ProcessInfo(99, 5000)],
        graphics_processes=[ProcessInfo(10, 100), ProcessInfo(12, 300)],
        util_samples=[UtilSample(11, 50, 40, 10), UtilSample(99, 60, 90, 90)],
    )
    sample = collector(FakeNvml([device])).sample(frozenset({10, 11, 12, 13}))

    got = {p.pid: (p.gpu_index, p.uuid, p.memory_bytes, p.sm_utilization_ratio)
           for p in sample.processes}
    assert got == {
        10: (0, device.uuid, 100, None),  # in both lists: counted once
        11: (0, device.uuid, None, pytest.approx(0.40)),  # memory unknown to the driver
        12: (0, device.uuid, 300, None),
    }


def test_last_seen_timestamp_is_carried_and_the_newest_sample_wins() -> None:
    device = FakeDevice(
        compute_processes=[ProcessInfo(10, 4096)],
        util_samples=[UtilSample(10, 100, 30, 5), UtilSample(10, 200, 60, 15),
                      UtilSample(99, 300, 90, 90)],  # not ours, but it moves the clock
    )
    gpu = collector(FakeNvml([device]))
    pids = frozenset({10})

    (p,) = gpu.sample(pids).processes
    assert p.sm_utilization_ratio == pytest.approx(0.60)
    assert p.memory_utilization_ratio == pytest.approx(0.15)

    device.util_samples.append(UtilSample(10, 400, 20, 1))
    (p,) = gpu.sample(pids).processes
    assert p.sm_utilization_ratio == pytest.approx(0.20)

    # Nothing newer: no utilization (not the stale 0.20), memory still reported.
    (p,) = gpu.sample(pids).processes
    assert (p.memory_bytes, p.sm_utilization_ratio, p.memory_utilization_ratio) == (
        4096, None, None)

    assert device.util_timestamps_asked == [0, 300, 400]


def test_process_utilization_not_supported_leaves_memory() -> None:
    device = FakeDevice(compute_processes=[ProcessInfo(10, 4096)],
                        not_supported={"nvmlDeviceGetProcessUtilization"})
    errors = ErrorLog()
    (p,) = collector(FakeNvml([device]), errors).sample(frozenset({10})).processes

    assert (p.memory_bytes, p.sm_utilization_ratio) == (4096, None)
    assert errors.counts() == {}


def test_zero_samples_reported_as_success_code_is_no_data() -> None:
    # pynvml raises NVMLError(NVML_SUCCESS) when NVML holds no samples at all.
    class Success(NVMLError):
        value = 0

    device = FakeDevice(compute_processes=[ProcessInfo(10, 4096)],
                        errors={"nvmlDeviceGetProcessUtilization": Success})
    errors = ErrorLog()
    (p,) = collector(FakeNvml([device]), errors).sample(frozenset({10})).processes

    assert p.sm_utilization_ratio is None
    assert errors.counts() == {}


def test_running_processes_fall_back_to_v2_on_old_drivers() -> None:
    device = FakeDevice(compute_processes=[ProcessInfo(10, 4096)])
    fake = FakeNvml([device], running_processes_mismatch=True)
    (p,) = collector(fake).sample(frozenset({10})).processes

    assert p.memory_bytes == 4096
    assert "nvmlDeviceGetComputeRunningProcesses_v2" in fake.calls


# -- the fake matches the real library ---------------------------------------------


def test_the_fake_matches_the_installed_pynvml() -> None:
    pynvml = pytest.importorskip("pynvml")
    fakes = [FakeNvml([FakeDevice(compute_processes=[ProcessInfo(10, 1)],
                                  util_samples=[UtilSample(10, 1, 1, 1)])]),
             FakeNvml(clocks_event_api=False, running_processes_mismatch=True)]
    called: set[str] = set()
    for fake in fakes:
        collector(fake).sample(frozenset({10}))
        called.update(fake.calls)
    missing = sorted(name for name in called if not hasattr(pynvml, name))
    assert missing == [], "the collector calls functions pynvml does not have"

    for fake in fakes:
        for name in dir(fake):
            if name.startswith(("NVML_", "nvmlClocks")):
                assert getattr(pynvml, name) == getattr(fake, name), name
            elif name.startswith("NVMLError_"):
                assert issubclass(getattr(pynvml, name), pynvml.NVMLError), name


def test_every_pid_on_a_gpu_is_listed_for_discovery_but_only_ours_are_read() -> None:
    fake = FakeNvml([FakeDevice(compute_processes=[ProcessInfo(10, 1024), ProcessInfo(11, 2048)]),
                     FakeDevice(uuid="GPU-bbbb", compute_processes=[ProcessInfo(12, 4096)])])
    sample = collector(fake).sample(frozenset({11}))
    assert sample.resident_pids == {10, 11, 12}
    assert [(p.pid, p.memory_bytes) for p in sample.processes] == [(11, 2048)]
