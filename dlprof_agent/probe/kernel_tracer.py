"""Kernel tracing in the probe: when CUPTI is started, given up and taken back,
how its buffers become totals, and how a windowed trace is captured.

Kept in one file: CUPTI's ownership (start, stand aside, come back, fail),
layer attribution and the trace window share one lock and one binding, and each
changes the others' state; what stands alone is elsewhere (``cuda_state``,
``trace_window``, ``kernel_records``, ``kernel_totals``).

The probe thread calls ``tick()`` a few times a second. Tracing starts once the
job uses CUDA (``torch.cuda.is_initialized()``, or libcuda mapped for other
frameworks) and kernels are wanted; it reports one of three states:

- ``active``: CUPTI is ours, buffers are decoded and folded in each tick;
- ``busy``: another CUPTI client uses the process (torch.profiler, TensorFlow's
  profiler, Nsight or another injection library), named in the reason;
  ``holder`` and ``since`` say who and since when. The framework's profiler
  entry points are wrapped (``profiler_yield``) so that we stand aside
  synchronously *before* the profiler touches CUPTI, and come back when it has
  stopped; checking whether a profiler runs, each tick, is the fallback;
- ``unavailable``: with the reason, e.g. "no CUDA in use", "cupti-python not
  installed", a CUDA major mismatch, or a failure of our own (counted).

Nothing here may hurt the job: every entry point catches everything. Imports
are the standard library's until tracing starts (``cupti_binding`` loads CUPTI,
and ``kernel_records``, ``kernel_names``, ``kernel_totals`` and ``record_clock``
numpy, only then).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from dlprof_agent.errors import CuptiBusy, CuptiUnavailable
from dlprof_agent.probe import cupti_binding, cupti_versions, profiler_yield
from dlprof_agent.probe.cuda_state import (
    cuda_in_use,
    device_uuids,
    foreign_profiler,
    injection_library,
)
from dlprof_agent.probe.messages import KernelSnapshot, TraceStatus
from dlprof_agent.probe.trace_window import Capture, cupti_clock_offset

if TYPE_CHECKING:
    from dlprof_agent.probe.activity_binding import ActivityBinding
    from dlprof_agent.probe.kernel_records import RecordSplitter
    from dlprof_agent.probe.kernel_totals import KernelAggregator
    from dlprof_agent.probe.record_clock import RecordClock

ACTIVE, BUSY, UNAVAILABLE = "active", "busy", "unavailable"
STATES = (ACTIVE, BUSY, UNAVAILABLE)
TICK_SECONDS = 0.25  # drain this often: buffers go back to the pool before it runs dry
# Hand over partly filled buffers this often (a non-forced cuptiActivityFlushAll):
# CUPTI's periodic flush returns only full ones, which a quiet job never fills.
FLUSH_SECONDS = 0.5
CUDA_CHECK_SECONDS = 1.0
BUSY_RETRY_SECONDS = 10.0
YIELD_RETRY_SECONDS = 2.0
COLLECT_SECONDS = 1.5  # after a window: CUPTI's flush period and a drain, with margin
MAX_COLLECT_SECONDS = 10.0

# CUpti_ActivityKind: what continuous tracing enables, and what attribution and
# the trace window's launch times add.
SWITCHED_OFF = "switched off (--no-kernels)"
PAUSED = "paused by the agent"
KINDS = (10, 1, 2, 17)  # CONCURRENT_KERNEL, MEMCPY, MEMSET, OVERHEAD
API_KINDS = (5, 4)  # RUNTIME, DRIVER: external correlation records come with these
ATTRIBUTION_KINDS = (39, *API_KINDS)  # EXTERNAL_CORRELATION
MAX_ATTRIBUTION_WEIGHT = (1 << 31) - 1  # steps a timed one stands for, in an external id


# The seam for tests: what a tracer gets when its caller names none. A test job
# sets these before enabling the probe, to run on a simulated GPU.
BINDING_FACTORY: Callable[[], ActivityBinding] = cupti_binding.CuptiBinding
CUDA_CHECK: Callable[[], bool] = cuda_in_use


class KernelTracer:
    """CUPTI for one probe session. Every public method catches everything."""

    def __init__(self, *, continuous: bool, max_layers: int,
                 binding_factory: Callable[[], ActivityBinding] | None = None,
                 cuda_check: Callable[[], bool] | None = None,
                 profiler_check: Callable[[], str] = foreign_profiler,
                 clock: Callable[[], float] = time.monotonic,
                 environ: Mapping[str, str] | None = None,
                 perf_ns: Callable[[], int] = time.perf_counter_ns,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.continuous = continuous
        self.max_layers = max_layers
        self._factory = binding_factory or BINDING_FACTORY
        self._cuda_check = cuda_check or CUDA_CHECK
        self._profiler_check = profiler_check
        self._clock = clock
        self._perf_ns, self._sleep = perf_ns, sleep  # what the records' clock is measured on
        self._environ = os.environ if environ is None else environ
        # The job's threads stand us aside (profiler_yield) while the probe thread ticks.
        self._lock = threading.RLock()
        self.state = UNAVAILABLE
        self.off_reason = SWITCHED_OFF  # why, while not continuous
        self.reason = SWITCHED_OFF if not continuous else "no CUDA in use"
        self.since = time.time()  # when the state last changed, Unix time
        self.holder = ""  # the other CUPTI client we stood aside for, while it runs
        self.errors = 0
        # The layer hooks push/pop its ids (a LayerCorrelator, or None). It and
        # ``recorder`` are Any, not Optional: the hooks and tests reach into them
        # where they know them set, and Optional would need narrowing at each use.
        self.correlator: Any = None
        self.layer_labels: list[str] | None = None  # the hooks' labels; None: no attribution
        self.capture: Capture | None = None
        self.recorder: Any = None  # a Recorder; gets ``capture`` while a window is open
        self._binding: ActivityBinding | None = None
        self._aggregator: KernelAggregator | None = None
        self._splitter: RecordSplitter | None = None
        self._record_clock: RecordClock | None = None  # made at each open
        self._generation = 0
        self._next_attempt = 0.0
        self._last_drain = 0.0
        self._last_flush = 0.0
        self._extra_kinds: list[int] = []
        # Attribution's kinds are on only in timed steps (the recorder's layer listener):
        # what the job's thread last asked for, (on, weight), and what was applied.
        self._attribution_wanted = (True, 1)
        self._attribution_applied: tuple[bool, int] | None = None
        self._id_base = 0
        self._temporary = False  # started for a trace only: stop after it
        self._dropped_before = 0
        self._unmeasured_before = 0  # batches earlier record clocks dropped
        self._dropped_base = 0
        self._devices: dict[str, str] = {}

    # The probe thread.

    def tick(self) -> None:
        with self._lock:
            try:
                self._tick(self._clock())
                self._apply_attribution()
            except Exception as error:
                self._fail(error)
        self._settle_attribution()

    def _tick(self, now: float) -> None:
        if self._binding is None:
            if (self.continuous or self.capture_open) and now >= self._next_attempt \
                    and not self.holder:
                self._start(now)
            self._expire_capture(now)
            return
        holder = self._profiler_check()
        if holder:
            self._yield(now, holder)
            return
        if now - self._last_drain >= TICK_SECONDS or self.capture_open:
            if now - self._last_flush >= FLUSH_SECONDS:
                self._flush(now)
            self._drain(now)
        self._advance_capture(now)

    def _flush(self, now: float) -> None:
        self._last_flush = now
        self._tracing().flush()

    def _tracing(self) -> ActivityBinding:
        """The binding, where the caller knows that CUPTI is ours."""
        binding = self._binding
        assert binding is not None  # a slip is caught, and counted, like any failure
        return binding

    @property
    def capture_open(self) -> bool:
        return self.capture is not None and self.capture.phase in (
            "waiting", "recording", "collecting")

    @property
    def tick_seconds(self) -> float | None:
        """How soon the probe thread should call tick() again; None: no hurry."""
        if self._binding is not None or self.capture_open:
            return TICK_SECONDS
        return CUDA_CHECK_SECONDS if self.continuous else None

    def _set(self, state: str, reason: str) -> None:
        if (state, reason[:160]) != (self.state, self.reason):
            self.since = time.time()
        self.state, self.reason = state, reason[:160]

    def _start(self, now: float) -> None:
        if not self._cuda_check():
            self._set(UNAVAILABLE, "no CUDA in use")
            self._next_attempt = now + CUDA_CHECK_SECONDS
            return
        holder = self.holder or self._profiler_check()
        if holder:
            self._set(BUSY, f"{holder} is running")
            self._next_attempt = now + YIELD_RETRY_SECONDS
            return
        injected = injection_library(self._environ)
        if injected:
            self._set(BUSY, f"CUPTI is held by {injected}")
            self._next_attempt = now + BUSY_RETRY_SECONDS
            return
        binding = self._factory()
        try:
            binding.open(*cupti_versions.framework_cuda())
            binding.enable(list(KINDS))
        except CuptiBusy as busy:
            self._set(BUSY, busy.reason)
            self._next_attempt = now + BUSY_RETRY_SECONDS
            return
        except CuptiUnavailable as unavailable:
            self._set(UNAVAILABLE, unavailable.reason)
            self._next_attempt = float("inf")  # it will not get better in this session
            return
        self._activate(binding, now)

    def _activate(self, binding: ActivityBinding, now: float) -> None:
        from dlprof_agent.probe import kernel_records, kernel_totals, record_clock

        # Another client may have put its clock on the records since we last traced.
        if self._record_clock is not None:
            self._unmeasured_before += self._record_clock.dropped_batches
        self._record_clock = record_clock.RecordClock(binding.timestamp_ns, self._perf_ns,
                                                      self._sleep)
        if self._aggregator is None:  # kept across restarts: the counters stay monotonic
            self._aggregator = kernel_totals.KernelAggregator()
        self._aggregator.names.forget_pointers()  # a restarted CUPTI has new strings
        self._splitter = kernel_records.RecordSplitter()  # sizes learned from this CUPTI
        self._generation = self._generation % 127 + 1
        base = self._id_base = self._generation << 24
        self.correlator = binding.correlator(base)
        # The hooks' own list, not a copy: it grows as they hook layers.
        labels = self.layer_labels if self.layer_labels is not None else []
        self._aggregator.layer_ids = kernel_totals.LayerIds(base, labels, self.max_layers)
        self._dropped_base = binding.counters().get("dropped_records", 0)
        self._devices = device_uuids()
        self._binding = binding
        self._last_drain = self._last_flush = now
        self._set(ACTIVE, "")
        self._attribution_applied = None
        self._apply_attribution()  # attribution's kinds, if the open step is timed
        profiler_yield.register(self)  # stand aside before the job's profiler starts

    def set_layers(self, labels: list[str] | None) -> None:
        """Attribute kernel time to these layers (the hooks' own list), or stop.
        Attribution follows the recorder's timed steps (``set_attribution``)."""
        try:
            with self._lock:
                self.layer_labels = labels
                if self._aggregator is not None:  # the record modules are loaded
                    from dlprof_agent.probe.kernel_totals import LayerIds

                    base = self._aggregator.layer_ids.base if self._aggregator.layer_ids else 0
                    self._aggregator.layer_ids = LayerIds(
                        base, labels if labels is not None else [], self.max_layers)
                recorder = self.recorder
                if recorder is not None:
                    listeners = recorder.layer_listeners
                    if labels is not None and self._layer_boundary not in listeners:
                        listeners.append(self._layer_boundary)
                    elif labels is None and self._layer_boundary in listeners:
                        listeners.remove(self._layer_boundary)
                    self._attribution_wanted = (bool(recorder.layer_step),
                                                recorder.layer_weight)
                self._apply_attribution()
        except Exception as error:
            self._fail(error)

    def _layer_boundary(self, timed: bool) -> None:
        """The recorder's layer listener, at each step boundary on the job's thread."""
        recorder = self.recorder
        self.set_attribution(timed, recorder.layer_weight if recorder is not None else 1)

    def set_attribution(self, on: bool, weight: int = 1) -> None:
        """Attribute the kernels of the step that begins now (``on``: a timed step
        standing for ``weight`` steps), or not: attribution's API kinds cost on
        every launch, so they are on only in timed steps. Called on the job's
        thread at every step boundary: it never waits for a tick (the tick applies
        what it asked for as it lets go of the lock), and does nothing while we
        stand aside, where ``open`` applies it when we come back."""
        try:
            wanted = (bool(on), min(max(1, int(weight)), MAX_ATTRIBUTION_WEIGHT))
            if wanted == self._attribution_wanted:
                return
            self._attribution_wanted = wanted
            if self._lock.acquire(blocking=False):
                try:
                    self._apply_attribution()
                finally:
                    self._lock.release()
        except Exception as error:
            self._fail(error)

    def _settle_attribution(self) -> None:
        """After letting go of the lock: what the job's thread asked for while we
        held it is applied now, not a tick later."""
        if self._attribution_wanted != self._attribution_applied:
            with self._lock:
                try:
                    self._apply_attribution()
                except Exception as error:
                    self._fail(error)

    def _apply_attribution(self) -> None:
        """Under the lock: attribution's kinds and the hooks' id weight as wanted."""
        wanted = self._attribution_wanted
        if wanted == self._attribution_applied:
            return
        self._attribution_applied = wanted
        binding = self._binding
        if binding is None:  # standing aside, or not tracing: open() applies it
            return
        on, weight = wanted
        if on and self.layer_labels is not None:
            if self.correlator is not None:
                from dlprof_agent.probe.kernel_totals import WEIGHT_SHIFT

                self.correlator.base = self._id_base | weight << WEIGHT_SHIFT
            binding.enable([kind for kind in ATTRIBUTION_KINDS if kind not in binding.enabled])
        elif not self.capture_open:  # a trace window keeps its launch times to its end
            binding.disable([kind for kind in ATTRIBUTION_KINDS if kind in binding.enabled])

    def set_continuous(self, continuous: bool, why: str = SWITCHED_OFF) -> None:
        """Switch continuous tracing on or off (``configure``), ``why`` off; a
        trace window being taken finishes first."""
        with self._lock:
            self.off_reason = why
            self._set_continuous(continuous)
        self._settle_attribution()

    def _set_continuous(self, continuous: bool) -> None:
        try:
            if continuous == self.continuous:
                return
            self.continuous = continuous
            if continuous:
                self._temporary = False
                self._next_attempt = 0.0
                return
            if self.capture_open:
                self._temporary = True
                return
            binding, self._binding = self._binding, None
            self.correlator = None
            if binding is not None:
                with contextlib.suppress(Exception):
                    self._drain_from(binding, self._clock(), final=True)
                binding.close()
            self._set(UNAVAILABLE, self.off_reason)
        except Exception as error:
            self._fail(error)

    def stand_aside(self, holder: str) -> None:
        """The job's profiler is about to use CUPTI (called on the job's thread,
        before it does): hand our last records over, turn our kinds off, and wait
        for ``come_back``. Never raises."""
        try:
            with self._lock:
                self.holder = holder
                now = self._clock()
                binding, self._binding = self._binding, None
                self.correlator = None
                if binding is not None:
                    try:
                        binding.close(forced=True)  # our kinds off, every buffer back
                        self._drain_from(binding, now, final=True)
                    finally:
                        self._dropped_before += (binding.counters().get("dropped_records", 0)
                                                 - self._dropped_base)
                if self.state != UNAVAILABLE or binding is not None:
                    self._set(BUSY, f"{holder} is running")
                self._temporary = False
                self._fail_capture(f"{holder} started")
        except Exception as error:
            self._fail(error)

    def come_back(self, holder: str) -> None:
        """The job's profiler has stopped: trace again from the next tick, when
        ``open`` registers our callbacks again and puts CUPTI's clock back."""
        with contextlib.suppress(Exception), self._lock:
            if self.holder == holder:
                self.holder = ""
                if self.state == BUSY:
                    self._next_attempt = 0.0

    def _yield(self, now: float, holder: str) -> None:
        """The job's own profiler took CUPTI over without our hooks seeing it start:
        its kinds are ours too now (CUPTI's are process-wide), so leave them on and
        come back after."""
        binding, self._binding = self._tracing(), None
        self.correlator = None
        with contextlib.suppress(Exception):
            self._drain_from(binding, now, final=True)
        self._dropped_before += binding.counters().get("dropped_records", 0) - self._dropped_base
        binding.abandon()
        self._temporary = False
        self._set(BUSY, f"{holder} is running")
        self._next_attempt = now + YIELD_RETRY_SECONDS
        self._fail_capture(f"{holder} started")

    def _fail_capture(self, error: str) -> None:
        if self.capture_open and self.capture is not None:
            self.capture.phase, self.capture.error = "failed", error
            if self.recorder is not None:
                self.recorder.capture = None

    def _fail(self, error: BaseException) -> None:
        """A failure of our own: stop tracing for this session, say why, go on."""
        self.errors += 1
        binding, self._binding = self._binding, None
        self.correlator = None
        if binding is not None:
            with contextlib.suppress(Exception):
                binding.close()
        self._temporary = False
        self._set(UNAVAILABLE, f"tracer failed: {type(error).__name__}: {error}")
        self._next_attempt = float("inf")
        if self.capture_open and self.capture is not None:
            self.capture.phase, self.capture.error = "failed", self.reason
            if self.recorder is not None:
                self.recorder.capture = None

    def stop(self) -> None:
        """The session ends: hand CUPTI back."""
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        profiler_yield.unregister(self)
        binding, self._binding = self._binding, None
        self.correlator = None
        if self.recorder is not None:
            self.recorder.capture = None
        if binding is not None:
            with contextlib.suppress(Exception):
                self._drain_from(binding, self._clock(), final=True)
            with contextlib.suppress(Exception):
                binding.close()
                binding.trim()

    # Buffers into totals.

    def _drain(self, now: float) -> None:
        self._drain_from(self._tracing(), now)

    def _drain_from(self, binding: ActivityBinding, now: float, final: bool = False) -> None:
        """Decode what CUPTI handed over and count it, once the records' clock is
        known (``record_clock``); ``final``: tracing stops, count what waited."""
        from dlprof_agent.probe import kernel_records as records

        splitter, aggregator, clock = self._splitter, self._aggregator, self._record_clock
        # All three are made as tracing started.
        assert splitter is not None and aggregator is not None and clock is not None
        batches = []
        for buffer in binding.take_buffers():
            try:
                batches.append(records.decode(
                    buffer.data, buffer.valid_bytes, splitter,
                    functools.partial(binding.record_size, buffer)))
            finally:
                binding.release(buffer)
        elapsed, self._last_drain = now - self._last_drain, now
        ready = clock.take(records.Batch.concat(batches), elapsed) if batches else []
        if final:
            ready += clock.settle()
        capture = self.capture
        if capture is not None and clock.converts:
            capture.offset_ns = clock.offset_ns  # its records are on perf_counter ns now
        for batch, seconds in ready:
            full_ids = aggregator.add(batch, seconds)
            if capture is not None and capture.phase in ("recording", "collecting"):
                capture.keep(batch, full_ids, aggregator)

    # Windowed traces.

    def start_capture(self, steps: int, max_seconds: float) -> str:
        """Begin a trace of the next ``steps`` steps; "" or why it cannot be had."""
        with self._lock:
            try:
                reply = self._start_capture(steps, max_seconds)
            except Exception as error:
                self._fail(error)
                reply = f"kernel tracing failed: {self.reason}"
        self._settle_attribution()
        return reply

    def _start_capture(self, steps: int, max_seconds: float) -> str:
        if self.capture_open:
            return "tracing busy: a trace of this process is already being taken"
        now = self._clock()
        if self._binding is None:
            if not self._cuda_check():
                return "no GPU in use: the process has not started CUDA"
            if self.state == UNAVAILABLE and self._next_attempt == float("inf"):
                return f"kernel tracing unavailable: {self.reason}"
            self._start(now)
            if self._binding is None:
                prefix = "tracing busy" if self.state == BUSY else "kernel tracing unavailable"
                return f"{prefix}: {self.reason}"
            self._temporary = not self.continuous
        binding = self._binding
        # The launches' own times (runtime/driver API records) mark a step's kernels.
        added = [kind for kind in (*API_KINDS, *(ATTRIBUTION_KINDS if self.layer_labels
                                                  is not None else ()))
                 if kind not in binding.enabled]
        binding.enable(added)
        self._extra_kinds = added
        self._drain(now)  # what came before the window is not part of it
        clock = self._record_clock
        offset = clock.offset_ns if clock is not None and clock.converts \
            else cupti_clock_offset(binding)
        capture = Capture(steps, now + max_seconds, offset)
        self.capture = capture
        if self.recorder is not None:
            self.recorder.capture = capture
        return ""

    def _expire_capture(self, now: float) -> None:
        capture = self.capture
        if capture is not None and capture.expire(now):
            self._end_capture()

    def _advance_capture(self, now: float) -> None:
        capture = self.capture
        if capture is None:
            return
        self._expire_capture(now)
        if capture.phase != "collecting":
            return
        if not capture.collect_since:
            capture.collect_since = now
            self._tracing().flush()  # not forced: only finished work is handed over
            return
        waited = now - capture.collect_since
        window_end_ns = round(capture.boundaries[-1] * 1e9) + capture.offset_ns
        # Done once the GPU has run work from after the window (it has caught up with
        # the window's launches), or after a longer wait for a GPU gone idle.
        if waited < COLLECT_SECONDS or (capture.latest_gpu_ns < window_end_ns
                                        and waited < MAX_COLLECT_SECONDS):
            self._tracing().flush()
            self._drain(now)
            return
        self._tracing().flush()
        self._drain(now)
        assert self._aggregator is not None  # made as tracing started
        capture.finish(self._aggregator.names, list(self.layer_labels or []), self._devices)
        self._end_capture()

    def _end_capture(self) -> None:
        if self.recorder is not None:
            self.recorder.capture = None
        binding = self._binding
        if binding is None:
            return
        binding.disable(self._extra_kinds)
        self._extra_kinds = []
        self._attribution_applied = None
        self._apply_attribution()  # the window may have ended in a timed step
        if self._temporary:
            self._temporary = False
            self._binding = None
            self.correlator = None
            with contextlib.suppress(Exception):
                binding.close()
            self._set(UNAVAILABLE, self.off_reason)
            self._next_attempt = float("inf") if not self.continuous else 0.0

    def capture_status(self, offset: int) -> TraceStatus:
        capture = self.capture
        if capture is None:
            return {"ok": False, "error": "no trace was asked for"}
        reply, delivered = capture.status(offset)
        if delivered:
            self.capture = None  # free it
        return reply

    def cancel_capture(self) -> None:
        if self.capture_open:
            with contextlib.suppress(Exception):
                self._end_capture()
        self.capture = None

    # The snapshot reply.

    def snapshot(self) -> KernelSnapshot:
        with self._lock:
            snapshot = self._snapshot()
        self._settle_attribution()
        return snapshot

    def _snapshot(self) -> KernelSnapshot:
        try:
            if self._binding is not None:
                now = self._clock()
                self._flush(now)  # what completed since the last tick, too
                self._drain(now)
        except Exception as error:
            self._fail(error)
        result: KernelSnapshot = {"state": self.state, "reason": self.reason,
                                  "errors": self.errors, "since": self.since}
        try:
            if self._aggregator is not None:
                result = {**result, **self._aggregator.snapshot()}
                dropped = self._dropped_before
                if self._binding is not None:
                    dropped += (self._binding.counters().get("dropped_records", 0)
                                - self._dropped_base)
                result["dropped_records"] = dropped
                clock = self._record_clock
                if clock is not None:
                    result["record_clock"] = {"clock": clock.state,
                                              "measured_by": clock.measured_by,
                                              "ticks_per_ns": clock.ticks_per_ns}
                    result["unmeasured_batches"] = (self._unmeasured_before
                                                    + clock.dropped_batches)
                result["devices"] = dict(self._devices)
        except Exception as error:
            self._fail(error)
        return result
