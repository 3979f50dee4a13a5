"""GpuCollector on the real pynvml: a GPU machine (``-m gpu``) and a machine without one."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from dlprof_agent.collectors.error_log import ErrorLog
from dlprof_agent.collectors.gpu import GpuCollector
from dlprof_agent.collectors.gpu_samples import GpuProcessSample, GpuSample

HAS_DRIVER = Path("/dev/nvidiactl").exists()

needs_driver = pytest.mark.skipif(not HAS_DRIVER,
                                  reason="no NVIDIA driver here (/dev/nvidiactl is missing)")


def _in_nested_pid_namespace() -> bool:
    # NVML reports host pids; inside a container's pid namespace ours differs.
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return len(line.split()) > 2
    return False


@pytest.mark.gpu
@needs_driver
def test_real_gpus_are_read_with_plausible_values(caplog: pytest.LogCaptureFixture) -> None:
    errors = ErrorLog()
    with caplog.at_level(logging.INFO, logger="dlprof_agent"):
        sample = GpuCollector(errors=errors).sample(frozenset({os.getpid()}))

    assert sample.available, caplog.text  # the log line says why not
    assert sample.driver_version
    assert sample.devices
    for d in sample.devices:
        assert d.up
        assert d.uuid.startswith("GPU-")
        assert d.name
        assert d.memory_total_bytes is not None and d.memory_total_bytes > 0
        assert d.memory_used_bytes is not None
        assert 0 <= d.memory_used_bytes <= d.memory_total_bytes
        for ratio in (d.utilization_ratio, d.memory_utilization_ratio):
            assert ratio is None or 0.0 <= ratio <= 1.0
        if d.power_watts is not None:
            assert 0 < d.power_watts < 5000
        if d.power_limit_watts is not None:
            assert 0 < d.power_limit_watts < 5000
        if d.energy_joules is not None:
            assert d.energy_joules > 0
        if d.temperature_celsius is not None:
            assert 0 < d.temperature_celsius < 130
        if d.sm_clock_hertz is not None:
            assert 0 <= d.sm_clock_hertz < 10e9
        if d.throttle_reasons is not None:
            assert "sw_power_cap" in dict(d.throttle_reasons)
    assert errors.counts() == {}


@pytest.mark.gpu
@needs_driver
def test_this_process_shows_up_with_its_gpu_memory_and_utilization() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    if _in_nested_pid_namespace():
        pytest.skip("in a container pid namespace: NVML's pids are the host's")

    pid = os.getpid()
    a = torch.randn(8192, 8192, device="cuda")  # 256 MiB, and enough work to be seen
    gpu = GpuCollector(errors=ErrorLog())
    gpu.sample(frozenset({pid}))  # the first read moves the utilization clock to now

    mine: list[GpuProcessSample] = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
        mine = [p for p in gpu.sample(frozenset({pid})).processes if p.pid == pid]
        if mine and any(p.sm_utilization_ratio for p in mine):
            break

    assert mine, "this process is not among the GPU's processes"
    assert any(p.memory_bytes is not None and p.memory_bytes >= 256 * 1024**2 for p in mine)
    assert any(p.sm_utilization_ratio is not None and 0 < p.sm_utilization_ratio <= 1
               for p in mine)


@pytest.mark.skipif(HAS_DRIVER, reason="this machine has an NVIDIA driver")
def test_without_a_driver_the_real_path_is_unavailable_and_quiet() -> None:
    errors = ErrorLog()
    gpu = GpuCollector(errors=errors)  # real pynvml, or none installed: both must be fine

    assert gpu.sample(frozenset({os.getpid()})) == GpuSample(available=False)
    assert gpu.sample(frozenset({os.getpid()})) == GpuSample(available=False)
    assert errors.counts() == {}
