"""One windowed trace (command ``trace``): N steps of kernels, copies, layer
ranges and step boundaries, kept as they come and sent as one columnar payload
(messages.TracePayload) that the agent turns into a Chrome trace
(``exporters/chrome_trace.py``). The kernel tracer opens and closes the window.

Imported by the tracer with the standard library only; numpy and the record
modules load when a window's records are first kept (tracing has started then).
"""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING

from dlprof_agent.probe.messages import TracePayload, TraceStatus

if TYPE_CHECKING:
    from dlprof_agent.probe.activity_binding import ActivityBinding
    from dlprof_agent.probe.kernel_names import KernelNames
    from dlprof_agent.probe.kernel_records import I64, U32, U64, Batch
    from dlprof_agent.probe.kernel_totals import KernelAggregator

MAX_TRACE_RECORDS = 500_000  # GPU records kept for one trace
MAX_TRACE_RANGES = 500_000  # layer ranges kept for one trace
TRACE_CHUNK_CHARS = 1 << 20  # per trace_status reply: well under the protocol's 4 MiB


def cupti_clock_offset(binding: ActivityBinding) -> int:
    """CUPTI's clock minus perf_counter's, in ns, from the tightest of a few reads."""
    best: tuple[int, int] | None = None
    for _ in range(5):
        before = time.perf_counter_ns()
        cupti_now = binding.timestamp_ns()
        after = time.perf_counter_ns()
        if best is None or after - before < best[0]:
            best = (after - before, cupti_now - (before + after) // 2)
    assert best is not None
    return best[1]


class Capture:
    """One windowed trace: N steps of kernels, copies, layer ranges and step
    boundaries. ``step`` and ``layer`` run on the job's threads: appends only."""

    def __init__(self, steps: int, deadline: float, offset_ns: int) -> None:
        self.wanted = steps
        self.deadline = deadline  # monotonic
        self.offset_ns = offset_ns  # CUPTI's clock minus perf_counter's, ns
        self.phase = "waiting"  # waiting, recording, collecting, done, failed
        # A boundary was handled on the job's thread since it was armed: the window
        # opens at a boundary whose step the job's thread set up for it (layer hooks
        # in), not at one replayed from the stamped events of before.
        self.live = False
        self.error = ""
        self.boundaries: list[float] = []  # perf_counter seconds
        self.layers: list[tuple[str, int, float, float, int]] = []
        # Decoded batches, with their kernels' full-name ids, layers and phases.
        self.gpu: list[tuple[Batch, I64, I64, I64]] = []
        self.records = 0
        self.truncated = False
        self.collect_since = 0.0
        self.latest_gpu_ns = 0  # the latest start of GPU work kept, CUPTI's clock
        self.payload = ""

    @property
    def steps_done(self) -> int:
        return max(0, len(self.boundaries) - 1)

    def step(self, now: float) -> None:
        if self.phase == "waiting":
            if not self.live:
                return
            self.boundaries.append(now)
            self.phase = "recording"
        elif self.phase == "recording":
            self.boundaries.append(now)
            if len(self.boundaries) > self.wanted:
                self.phase = "collecting"

    def layer(self, label: str, phase: str, start: float, end: float) -> None:
        if self.phase == "recording":
            if len(self.layers) < MAX_TRACE_RANGES:
                self.layers.append((label, phase == "backward", start, end,
                                    threading.get_ident()))
            else:
                self.truncated = True

    def keep(self, batch: Batch, full_ids: I64, aggregator: KernelAggregator) -> None:
        """A drained batch of records, with the layer each kernel ran for."""
        if self.records >= MAX_TRACE_RECORDS:
            self.truncated = True
            return
        found, external = aggregator.attribution.lookup(batch.kernel_correlation)
        assert aggregator.layer_ids is not None  # set whenever the tracer is active
        layer, phase = aggregator.layer_ids.decode(external)
        layer[~found] = -1
        self.gpu.append((batch, full_ids, layer, phase))
        self.records += len(batch.kernel_start) + len(batch.copy_start)
        if len(batch.kernel_start):
            self.latest_gpu_ns = max(self.latest_gpu_ns, int(batch.kernel_start.max()))

    def expire(self, now: float) -> bool:
        """Fail the window if its time is up before its steps were seen."""
        if self.phase not in ("waiting", "recording") or now <= self.deadline:
            return False
        self.phase = "failed"
        self.error = (f"only {self.steps_done} of {self.wanted} steps before the time limit"
                      if self.boundaries else
                      "no training step was seen before the time limit")
        return True

    def finish(self, names: KernelNames, labels: list[str], devices: dict[str, str]) -> None:
        """Every record is in: make the payload and let the records go."""
        self.payload = json.dumps(self._payload(names, labels, devices), separators=(",", ":"))
        self.gpu, self.layers = [], []
        self.phase = "done"

    def status(self, offset: int) -> tuple[TraceStatus, bool]:
        """The reply to ``trace_status``, and whether the payload is now delivered."""
        reply: TraceStatus = {"ok": self.phase != "failed", "phase": self.phase,
                              "steps": self.steps_done, "wanted": self.wanted}
        delivered = False
        if self.phase == "failed":
            reply["error"] = self.error
        elif self.phase == "done":
            reply["size"] = len(self.payload)
            reply["data"] = self.payload[offset:offset + TRACE_CHUNK_CHARS]
            delivered = offset + TRACE_CHUNK_CHARS >= len(self.payload)
        return reply, delivered

    def _payload(self, names: KernelNames, labels: list[str], devices: dict[str, str]
                 ) -> TracePayload:
        """The window's records, columnar, on CUPTI's clock (ns), for the agent's
        trace writer (``exporters/chrome_trace.py``)."""
        import numpy as np
        import numpy.typing as npt

        from dlprof_agent.probe import kernel_records

        offset = self.offset_ns
        bounds = [round(t * 1e9) + offset for t in self.boundaries]
        first, last = bounds[0], bounds[-1]
        batch = kernel_records.Batch.concat([part[0] for part in self.gpu])
        full_ids = np.concatenate([part[1] for part in self.gpu] or [np.zeros(0, int)])
        layer = np.concatenate([part[2] for part in self.gpu] or [np.zeros(0, int)])
        phase = np.concatenate([part[3] for part in self.gpu] or [np.zeros(0, int)])
        # Kernels launched inside the window (by their API call's time), whenever they ran.
        launched = batch.api_correlation[(batch.api_start >= first) & (batch.api_start <= last)]

        def in_window(correlation: U32, start: U64) -> npt.NDArray[np.bool_]:
            if len(batch.api_start):
                return np.isin(correlation, launched)
            return (start >= first) & (start <= last)

        kernels = in_window(batch.kernel_correlation, batch.kernel_start) & (
            batch.kernel_end > batch.kernel_start)
        copies = in_window(batch.copy_correlation, batch.copy_start) & (
            batch.copy_end > batch.copy_start)
        return {
            "steps": bounds,
            "kernels": {"start": batch.kernel_start[kernels].tolist(),
                        "end": batch.kernel_end[kernels].tolist(),
                        "device": batch.kernel_device[kernels].tolist(),
                        "stream": batch.kernel_stream[kernels].tolist(),
                        "correlation": batch.kernel_correlation[kernels].tolist(),
                        "name": full_ids[kernels].tolist(),
                        "layer": layer[kernels].tolist(), "phase": phase[kernels].tolist()},
            "names": list(names.names), "full_names": list(names.full),
            "full_to_name": list(names.full_to_name),
            "memcpy": {"start": batch.copy_start[copies].tolist(),
                       "end": batch.copy_end[copies].tolist(),
                       "device": batch.copy_device[copies].tolist(),
                       "stream": batch.copy_stream[copies].tolist(),
                       "kind": [kernel_records.MEMCPY_KINDS[min(k, 10)]
                                for k in batch.copy_kind[copies].tolist()],
                       "bytes": batch.copy_bytes[copies].tolist()},
            "labels": list(labels),
            "layers": [[label, int(backward), round(start * 1e9) + offset,
                        round(end * 1e9) + offset, thread]
                       for label, backward, start, end, thread in self.layers],
            "devices": dict(devices),
            "truncated": self.truncated,
        }
