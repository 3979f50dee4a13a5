"""The windowed trace as Chrome trace event JSON: what Perfetto and
chrome://tracing need from every event, and where each kind of event goes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dlprof_agent.exporters import chrome_trace as trace_writer

BASE = 5_000_000_000_000  # ns, CUPTI's clock


def payload() -> dict[str, Any]:
    return {
        "steps": [BASE, BASE + 100_000_000, BASE + 210_000_000],
        "names": ["[memset]", "at::native::vectorized_elementwise_kernel", "gemm"],
        "full_names": ["[memset]", "void at::native::vectorized_elementwise_kernel<4>(int)",
                       "gemm_full"],
        "full_to_name": [0, 1, 2],
        "kernels": {"start": [BASE + 1_000, BASE + 5_000, BASE + 120_000_000],
                    "end": [BASE + 3_500, BASE + 6_000, BASE + 150_000_000],
                    "device": [0, 0, 1], "stream": [7, 7, 13], "correlation": [1, 2, 3],
                    "name": [1, 0, 2], "layer": [0, -1, 1], "phase": [0, 0, 1]},
        "memcpy": {"start": [BASE + 10_000], "end": [BASE + 20_000], "device": [0],
                   "stream": [14], "kind": ["h2d"], "bytes": [1 << 20]},
        "labels": ["conv1", "fc"],
        "layers": [["conv1", 0, BASE + 500, BASE + 4_000, 111],
                   ["fc", 1, BASE + 110_000_000, BASE + 119_000_000, 222]],
        "devices": {"0": "GPU-aaaa", "1": "GPU-bbbb"},
        "truncated": False,
    }


def check_event(event: dict[str, Any]) -> None:
    """What every consumer of the format relies on."""
    assert event["ph"] in ("X", "i", "M")
    assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
    assert isinstance(event["name"], str) and event["name"]
    if event["ph"] == "X":
        assert isinstance(event["ts"], float | int) and isinstance(event["dur"], float | int)
        assert event["dur"] >= 0
    if event["ph"] == "i":
        assert event["s"] in ("g", "p", "t")
    if event["ph"] == "M":
        assert "name" in event["args"] or "sort_index" in event["args"]


def test_every_event_is_well_formed_and_the_document_round_trips(tmp_path: Path) -> None:
    trace = trace_writer.chrome_trace(payload(), pid=4242, process_name="python (pid 4242)",
                                      version="0.1.0")
    path = tmp_path / "trace.json"
    trace_writer.write(trace, str(path))
    loaded = json.loads(path.read_text())

    assert set(loaded) == {"traceEvents", "displayTimeUnit", "otherData"}
    assert loaded["otherData"]["steps"] == 2 and loaded["otherData"]["pid"] == 4242
    for event in loaded["traceEvents"]:
        check_event(event)
    timed = [e["ts"] for e in loaded["traceEvents"] if e["ph"] != "M"]
    assert timed == sorted(timed)
    first_timed = next(i for i, e in enumerate(loaded["traceEvents"]) if e["ph"] != "M")
    assert all(e["ph"] != "M" for e in loaded["traceEvents"][first_timed:])


def by_name(trace: dict[str, Any], name: str) -> dict[str, Any]:
    return next(e for e in trace["traceEvents"] if e["name"] == name)


def test_steps_are_ranges_and_boundaries_on_the_jobs_process() -> None:
    trace = trace_writer.chrome_trace(payload(), pid=4242)
    steps = [e for e in trace["traceEvents"] if e.get("cat") == "step" and e["ph"] == "X"]
    marks = [e for e in trace["traceEvents"] if e.get("cat") == "step" and e["ph"] == "i"]
    assert [(e["name"], e["ts"], e["dur"]) for e in steps] == [
        ("step 1", 0.0, 100_000.0), ("step 2", 100_000.0, 110_000.0)]
    assert [e["ts"] for e in marks] == [0.0, 100_000.0, 210_000.0]
    assert {e["pid"] for e in steps + marks} == {4242}


def test_gpu_work_is_on_a_track_per_device_and_stream() -> None:
    trace = trace_writer.chrome_trace(payload(), pid=4242)
    kernel = by_name(trace, "at::native::vectorized_elementwise_kernel")
    assert kernel["pid"] == trace_writer.GPU_PID_BASE and kernel["tid"] == 7
    assert (kernel["ts"], kernel["dur"]) == (1.0, 2.5)  # microseconds from the window's start
    assert kernel["args"]["kernel"] == "void at::native::vectorized_elementwise_kernel<4>(int)"
    assert (kernel["args"]["layer"], kernel["args"]["phase"]) == ("conv1", "forward")
    memset = by_name(trace, "[memset]")
    assert memset["cat"] == "memset" and "layer" not in memset["args"]
    gemm = by_name(trace, "gemm")
    assert gemm["pid"] == trace_writer.GPU_PID_BASE + 1 and gemm["tid"] == 13
    assert gemm["args"]["phase"] == "backward"
    copy = by_name(trace, "memcpy h2d")
    assert copy["tid"] == 14 and copy["args"]["bytes"] == 1 << 20
    assert copy["args"]["bytes_per_second"] == pytest.approx((1 << 20) / 10e-6, rel=1e-3)

    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
                 if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes[trace_writer.GPU_PID_BASE] == "GPU 0 (GPU-aaaa)"
    assert processes[trace_writer.GPU_PID_BASE + 1] == "GPU 1 (GPU-bbbb)"
    assert names[(trace_writer.GPU_PID_BASE, 7)] == "stream 7"
    assert names[(trace_writer.GPU_PID_BASE, 14)] == "stream 14"


def test_layer_ranges_are_on_their_host_threads() -> None:
    trace = trace_writer.chrome_trace(payload(), pid=4242)
    conv = by_name(trace, "conv1 (forward)")
    fc = by_name(trace, "fc (backward)")
    assert conv["pid"] == fc["pid"] == 4242
    assert conv["tid"] != fc["tid"]  # forward on the main thread, backward on autograd's
    assert (conv["ts"], conv["dur"]) == (0.5, 3.5)
    assert trace_writer.summary(trace) == {"step": 2, "layer": 2, "kernel": 2, "memset": 1,
                                           "memcpy": 1}


def test_an_empty_window_is_still_a_valid_trace() -> None:
    empty = {"steps": [BASE, BASE + 1000], "kernels": {}, "memcpy": {}, "layers": []}
    trace = trace_writer.chrome_trace(empty, pid=1)
    for event in trace["traceEvents"]:
        check_event(event)
    assert trace_writer.summary(trace) == {"step": 1}
