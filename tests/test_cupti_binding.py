"""The CUPTI binding's parts that need no GPU: the C buffer callbacks and their
pool (called through their real ctypes trampolines, as CUPTI calls them), the
CUDA-major check, and what happens where cupti-python is missing."""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from dlprof_agent.probe import cupti_binding as cb
from dlprof_agent.probe import cupti_versions as cv
from dlprof_agent.probe import kernel_records as kr
from dlprof_agent.probe import kernel_tracer as kt
from tests.conftest import agent_env
from tests.cupti_records import BufferBuilder


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[cb._BufferPool]:
    pool = cb._BufferPool(ctypes.CDLL(None))
    pool.buffer_bytes = 1 << 16
    pool.limit = 2
    monkeypatch.setattr(cb, "_pool", pool)
    yield pool
    for address in list(pool.owned):
        pool.release(address)
    pool.trim()


def request(callback: Any) -> tuple[int, int, int]:
    buffer, size, records = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t(99)
    callback(ctypes.byref(buffer), ctypes.byref(size), ctypes.byref(records))
    return buffer.value or 0, size.value, records.value


def test_buffers_go_to_cupti_and_come_back_decodable(pool: cb._BufferPool) -> None:
    requested = cb._REQUESTED(pool.requested)
    completed = cb._COMPLETED(pool.completed_callback)
    dropped_reports: list[tuple[Any, int]] = []

    def get_dropped(context: Any, stream: int, dropped: Any) -> int:
        dropped_reports.append((context, stream))
        dropped._obj.value = 2
        return 0

    pool.get_dropped = get_dropped
    address, size, max_records = request(requested)
    assert address and size == 1 << 16 and max_records == 0
    assert address % 8 == 0  # CUPTI wants 8-byte aligned buffers

    builder = BufferBuilder().kernel("gemm", 100, 200).memcpy(1, 64, 300, 400)
    data = builder.bytes()
    ctypes.memmove(address, data, len(data))
    completed(None, 0, address, size, len(data))  # as CUPTI hands a buffer back

    (buffer,) = cb.CuptiBinding().take_buffers()
    batch = kr.decode(buffer.data, buffer.valid_bytes,
                      kr.RecordSplitter(builder.sizes()))
    assert batch.kernel_start.tolist() == [100] and batch.copy_bytes.tolist() == [64]
    assert pool.dropped_records == 2 and dropped_reports == [(None, 0)]
    cb.CuptiBinding().release(buffer)
    assert request(requested)[0] == address  # recycled, not a new malloc


def test_an_exhausted_pool_gives_cupti_no_buffer_and_counts_it(pool: cb._BufferPool) -> None:
    requested = cb._REQUESTED(pool.requested)
    first, second = request(requested)[0], request(requested)[0]
    assert first and second and first != second
    assert request(requested)[:2] == (0, 0)  # CUPTI drops records, and says how many
    assert pool.refused_requests == 1


def test_a_buffer_that_is_not_ours_is_left_alone(pool: cb._BufferPool) -> None:
    completed = cb._COMPLETED(pool.completed_callback)
    foreign = ctypes.create_string_buffer(64)
    completed(None, 0, ctypes.addressof(foreign), 64, 64)
    assert not pool.completed and pool.foreign_buffers == 1


def test_the_callbacks_never_raise_into_cupti(pool: cb._BufferPool) -> None:
    def broken(*args: Any) -> int:
        raise RuntimeError("broken on purpose")

    pool.get_dropped = broken
    completed = cb._COMPLETED(pool.completed_callback)
    completed(None, 0, None, 0, 0)  # returns normally
    pool.requested(None, None, None)  # nonsense arguments: counted, not raised
    assert pool.callback_errors == 2


def test_idle_buffers_are_freed_when_tracing_stops(pool: cb._BufferPool) -> None:
    requested = cb._REQUESTED(pool.requested)
    address = request(requested)[0]
    held_by_cupti = request(requested)[0]
    pool.release(address)
    pool.trim()
    assert pool.owned == {held_by_cupti} and not pool.free


@pytest.mark.parametrize(("ours", "framework", "theirs", "ok"), [
    ("12.8.0", "torch", "12.4", True), ("13.4.0", "torch", "13.0", True),
    ("13.4.0", "torch", "12.8", False), ("12.8.0", "tensorflow", "13.0", False),
    ("13.4.0", "torch", None, True)])
def test_cupti_python_must_match_the_frameworks_cuda_major(
        ours: str, framework: str, theirs: str | None, ok: bool) -> None:
    why = cv.cuda_mismatch(ours, framework, theirs)
    assert (why is None) == ok
    if why is not None:
        assert theirs is not None
        assert why == (f"cupti-python {ours} is for CUDA {ours.partition('.')[0]} but "
                       f"{framework} uses CUDA {theirs}: pip install 'cupti-python=="
                       f"{theirs}.*' in the job's environment")


def test_the_install_command_keeps_the_frameworks_cupti() -> None:
    # torch 2.11+cu130 ships CUPTI 13.0.85; 'cupti-python==13.*' resolves to 13.4,
    # which requires nvidia-cuda-cupti~=13.4 and so replaces it (GPU evidence 2026-11-23).
    assert cv.install_command("13.0.85") == "pip install 'cupti-python==13.0.*'"
    assert cv.install_command("12.8") == "pip install 'cupti-python==12.8.*'"
    assert cv.install_command("") == (
        "pip install 'cupti-python==X.Y.*' for the framework's CUDA X.Y")
    assert cv.cuda_mismatch("13.4.0", "torch", "12.8", "12.8.90") == (
        "cupti-python 13.4.0 is for CUDA 13 but torch uses CUDA 12.8: pip install "
        "'cupti-python==12.8.*' in the job's environment")


def test_the_jobs_cupti_version_comes_from_its_wheel_or_the_loaded_library(
        monkeypatch: pytest.MonkeyPatch) -> None:
    installed = {"nvidia-cuda-cupti": "13.0.85"}

    def version(name: str) -> str:
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert cv.framework_cupti_version("13.0", maps=[]) == "13.0.85"
    installed.clear()
    installed["nvidia-cuda-cupti-cu12"] = "12.8.90"
    assert cv.framework_cupti_version("12.8", maps=[]) == "12.8.90"
    installed.clear()
    assert cv.framework_cupti_version(
        "12.4", maps=["/opt/conda/lib/libcupti.so.12.4.127"]) == "12.4.127"
    assert cv.framework_cupti_version("13.0", maps=[]) == "13.0"


def test_the_holder_is_named_from_the_environment_when_cupti_does_not() -> None:
    assert cv.holder_hint({"CUDA_INJECTION64_PATH": "/opt/nsys/libToolsInjection64.so"}) == \
        "Nsight Systems"
    assert cv.holder_hint({"CUDA_INJECTION64_PATH": "/x/libmyinjector.so"}) == \
        "the injection library libmyinjector.so"
    assert cv.holder_hint({}).startswith("another CUPTI client")


@pytest.mark.skipif(importlib.util.find_spec("cupti") is not None,
                    reason="cupti-python is installed here")
def test_without_cupti_python_the_tracer_says_so_and_the_job_is_untouched() -> None:
    tracer = kt.KernelTracer(continuous=True, max_layers=512, cuda_check=lambda: True)
    tracer.tick()
    assert tracer.state == "unavailable"
    assert tracer.reason.startswith("cupti-python not installed in the job's environment: "
                                    "pip install ")
    assert tracer.start_capture(3, 60).startswith("kernel tracing unavailable: cupti-python")
    assert tracer.errors == 0


def test_importing_the_probe_loads_neither_numpy_nor_cupti() -> None:
    check = ("import sys, dlprof_agent.probe.runtime, dlprof_agent.probe.kernel_tracer;"
             "print(sorted(m for m in ('numpy', 'cupti') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", check], env=agent_env(),
                            capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"
