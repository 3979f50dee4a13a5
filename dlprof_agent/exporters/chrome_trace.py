"""A probe's trace window as Chrome trace event JSON, for Perfetto (ui.perfetto.dev)
and chrome://tracing.

The probe sends the window's records columnar (``TracePayload`` in
``probe/messages.py``), all on CUPTI's clock in ns (it has shifted its own
perf_counter times by the offset it measured between the two clocks, sampling
cuptiGetTimestamp; the binding puts CUPTI's own clock back whenever tracing
starts, as another client's timestamp callback, Kineto's TSC, would make the
records' units differ from that sample's); this module, run by the agent,
turns them into events:

- the job's process: a ``steps`` track with one ``X`` event per step and an
  ``i`` instant at each boundary, and one track per host thread with the
  layers' forward and backward ranges;
- one process per GPU (pid ``GPU_PID_BASE + device``), one thread per stream,
  holding kernels, memsets and memcpys as ``X`` events.

``ts`` and ``dur`` are microseconds from the window's first step boundary. The
standard library only: the agent has no numpy.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Mapping
from typing import Any

GPU_PID_BASE = 1 << 30  # above any Linux pid (at most 2^22)
STEPS_TID = 0


def _us(ns: int, base: int) -> float:
    return round((ns - base) / 1000.0, 3)


def _metadata(pid: int, name: str, sort_index: int) -> list[dict[str, Any]]:
    return [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
             "args": {"sort_index": sort_index}}]


def _thread(pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def _columns(table: dict[str, list[Any]]) -> Iterator[dict[str, Any]]:
    keys = list(table)
    for values in zip(*(table[key] for key in keys), strict=True):
        yield dict(zip(keys, values, strict=True))


def chrome_trace(payload: Mapping[str, Any], *, pid: int, process_name: str = "",
                 version: str = "") -> dict[str, Any]:
    """The trace event document for one window (see the module doc): ``payload``
    is a TracePayload as parsed from the probe's JSON, the document the trace
    event format's JSON (both are plain JSON values, hence Any)."""
    steps: list[int] = payload["steps"]
    base = steps[0] if steps else 0
    events: list[dict[str, Any]] = _metadata(pid, process_name or f"pid {pid}", 0)
    events.append(_thread(pid, STEPS_TID, "steps"))
    for number, (start, end) in enumerate(itertools.pairwise(steps), 1):
        events.append({"ph": "X", "cat": "step", "name": f"step {number}", "pid": pid,
                       "tid": STEPS_TID, "ts": _us(start, base), "dur": _us(end, start)})
    for boundary in steps:
        events.append({"ph": "i", "s": "p", "cat": "step", "name": "step boundary",
                       "pid": pid, "tid": STEPS_TID, "ts": _us(boundary, base)})

    threads: dict[int, int] = {}
    for label, backward, start, end, thread in payload.get("layers", []):
        tid = threads.get(thread)
        if tid is None:
            tid = threads[thread] = len(threads) + 1
            events.append(_thread(pid, tid, f"host thread {tid}"))
        phase = "backward" if backward else "forward"
        events.append({"ph": "X", "cat": "layer", "name": f"{label} ({phase})", "pid": pid,
                       "tid": tid, "ts": _us(start, base), "dur": _us(end, start),
                       "args": {"layer": label, "phase": phase}})

    devices: dict[str, str] = payload.get("devices", {})
    tracks: set[tuple[int, int]] = set()

    def gpu_track(device: int, stream: int) -> int:
        gpu_pid = GPU_PID_BASE + device
        if (device, -1) not in tracks:
            tracks.add((device, -1))
            uuid = devices.get(str(device))
            events.extend(_metadata(gpu_pid, f"GPU {device}" + (f" ({uuid})" if uuid else ""),
                                    device + 1))
        if (device, stream) not in tracks:
            tracks.add((device, stream))
            events.append(_thread(gpu_pid, stream, f"stream {stream}"))
        return gpu_pid

    names, full_names = payload.get("names", []), payload.get("full_names", [])
    full_to_name = payload.get("full_to_name", [])
    labels = payload.get("labels", [])
    for kernel in _columns(payload.get("kernels", {})):
        full_id = kernel["name"]
        name = names[full_to_name[full_id]] if full_id < len(full_to_name) else "kernel"
        args: dict[str, Any] = {"kernel": full_names[full_id] if full_id < len(full_names)
                                else name, "device": kernel["device"],
                                "stream": kernel["stream"], "correlation": kernel["correlation"]}
        if 0 <= kernel.get("layer", -1) < len(labels):
            args["layer"] = labels[kernel["layer"]]
            args["phase"] = "backward" if kernel.get("phase") else "forward"
        events.append({"ph": "X", "cat": "memset" if name == "[memset]" else "kernel",
                       "name": name, "pid": gpu_track(kernel["device"], kernel["stream"]),
                       "tid": kernel["stream"], "ts": _us(kernel["start"], base),
                       "dur": _us(kernel["end"], kernel["start"]), "args": args})
    for copy in _columns(payload.get("memcpy", {})):
        seconds = max(copy["end"] - copy["start"], 1) / 1e9
        events.append({"ph": "X", "cat": "memcpy", "name": f"memcpy {copy['kind']}",
                       "pid": gpu_track(copy["device"], copy["stream"]), "tid": copy["stream"],
                       "ts": _us(copy["start"], base), "dur": _us(copy["end"], copy["start"]),
                       "args": {"bytes": copy["bytes"], "kind": copy["kind"],
                                "bytes_per_second": round(copy["bytes"] / seconds)}})

    events.sort(key=lambda event: (event["ph"] != "M", event.get("ts", 0.0)))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"tool": "dlprof-agent", "version": version, "pid": pid,
                      "steps": max(0, len(steps) - 1),
                      "truncated": bool(payload.get("truncated", False))},
    }


def summary(trace: dict[str, Any]) -> dict[str, int]:
    """How many events of each category the trace holds."""
    counts: dict[str, int] = {}
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            counts[event["cat"]] = counts.get(event["cat"], 0) + 1
    return counts


def write(trace: dict[str, Any], path: str) -> None:
    with open(path, "w") as file:
        json.dump(trace, file, separators=(",", ":"))
        file.write("\n")
