"""Fakes at the CUPTI seam, for tests without a GPU.

- ``FakeCupti``: libcupti's Activity API as ``probe.cupti_binding.CuptiBinding``
  calls it, so the real binding (its C buffer callbacks and pool included) runs
  on it, and Kineto (torch.profiler's CUPTI client) beside it. Each behaviour
  the probe depends on is modelled after a source, cited where it is modelled.
- ``FakeBinding``: a stand-in for the binding itself, handing the tracer
  synthetic activity buffers laid out as CUPTI lays them out
  (``tests.cupti_records``); ``SimulatedGpu`` runs one kernel per layer launch.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dlprof_agent.errors import CuptiBusy, CuptiUnavailable
from dlprof_agent.probe.cupti_binding import ActivityBuffer
from tests.cupti_records import LAYOUTS, BufferBuilder

CUPTI_MINUS_PERF_NS = 10**12  # the fake CUPTI clock runs this far ahead of perf_counter


class RecordingCorrelator:
    """Remembers every push and pop, per thread, as CUPTI's stacks would."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.failures = 0
        self.calls: list[tuple[str, int]] = []
        self.stacks: dict[int, list[int]] = {}

    def push(self, external_id: int) -> None:
        self.calls.append(("push", external_id))
        self.stacks.setdefault(threading.get_ident(), []).append(external_id)

    def pop(self) -> None:
        self.calls.append(("pop", 0))
        stack = self.stacks.get(threading.get_ident())
        if stack:
            stack.pop()
        else:
            self.failures += 1  # CUPTI would answer CUPTI_ERROR_QUEUE_EMPTY


class FakeBinding:
    """What the tracer asks of CUPTI, answered from queued buffers."""

    def __init__(self, *, version: str = "13.4", refuse: Exception | None = None) -> None:
        self.version = version
        self.refuse = refuse
        self.opened = False
        self.closed = False
        self.abandoned = False
        self._enabled: list[int] = []
        self.queue: list[bytes] = []
        self.dropped = 0
        self.flushes = 0
        self.released = 0
        self.size_questions = 0
        self.correlators: list[RecordingCorrelator] = []
        self.fail_on_take: Exception | None = None
        self._builders: list[BufferBuilder] = []  # their name strings must stay alive

    # The tracer's side.

    def open(self, framework: str = "", framework_cuda: str | None = None) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.opened = True

    @property
    def enabled(self) -> tuple[int, ...]:
        return tuple(self._enabled)

    def enable(self, kinds: list[int]) -> None:
        self._enabled += [kind for kind in kinds if kind not in self._enabled]

    def disable(self, kinds: list[int]) -> None:
        self._enabled = [kind for kind in self._enabled if kind not in kinds]

    def flush(self, *, forced: bool = False) -> None:
        self.flushes += 1

    def take_buffers(self) -> list[ActivityBuffer]:
        if self.fail_on_take is not None:
            raise self.fail_on_take
        taken, self.queue = self.queue, []
        # CUPTI's buffers are 8-aligned memory of their own: copy into such.
        return [ActivityBuffer(np.frombuffer(data, dtype=np.uint8).copy(), len(data))
                for data in taken]

    def release(self, buffer: ActivityBuffer) -> None:
        self.released += 1

    def record_size(self, buffer: ActivityBuffer, offset: int) -> int | None:
        """As cuptiActivityGetNextRecord tells it: from the record's kind."""
        self.size_questions += 1
        kind = int(np.frombuffer(buffer.data, dtype=np.int32, count=1,
                                 offset=offset)[0])
        layout = LAYOUTS[self.version].get(kind)
        return None if layout is None else layout.itemsize

    def counters(self) -> dict[str, int]:
        return {"dropped_records": self.dropped}

    def timestamp_ns(self) -> int:
        return time.perf_counter_ns() + CUPTI_MINUS_PERF_NS

    def correlator(self, base: int) -> RecordingCorrelator:
        correlator = RecordingCorrelator(base)
        self.correlators.append(correlator)
        return correlator

    def close(self, *, forced: bool = False) -> None:
        self.closed = True

    def abandon(self) -> None:
        self.abandoned = True

    @staticmethod
    def trim() -> None:
        pass

    # The test's side.

    def deliver(self, builder: BufferBuilder) -> None:
        self._builders.append(builder)
        self.queue.append(builder.bytes())


def busy(reason: str = "CUPTI is held by nsys") -> FakeBinding:
    return FakeBinding(refuse=CuptiBusy(reason))


def unavailable(reason: str = "cupti-python not installed in the job's environment"
                ) -> FakeBinding:
    return FakeBinding(refuse=CuptiUnavailable(reason))


class SteppedTime:
    """perf_counter and the fake CUPTI's clock, moved only by the test (``sleep``):
    a rate measured on them comes out exact however loaded the machine is."""

    def __init__(self, perf_seconds: float = 5_000.0) -> None:
        self.perf = round(perf_seconds * 1e9)

    def perf_ns(self) -> int:
        return self.perf

    def perf_seconds(self) -> float:
        return self.perf / 1e9

    def cupti_ns(self) -> int:
        return self.perf + CUPTI_MINUS_PERF_NS

    def sleep(self, seconds: float) -> None:
        self.perf += round(seconds * 1e9)


def now_on_cupti_clock(perf_seconds: float | None = None) -> int:
    seconds = time.perf_counter() if perf_seconds is None else perf_seconds
    return round(seconds * 1e9) + CUPTI_MINUS_PERF_NS


class SimulatedGpu(FakeBinding):
    """A GPU that runs one kernel for every launch a layer makes, as CUPTI would
    report it: an external correlation record with the layer's id, the launch's
    API record, then the kernel; and copies the batch to the device before the
    first layer's forward. For a real probe in a test job
    (``tests/jobs/torch_cnn.py --fake-cupti``): it needs the layer hooks."""

    KERNEL = "void simulated::layer_kernel<float>(float*, int)"
    COPY_BYTES = 1 << 16

    def __init__(self) -> None:
        super().__init__()
        self._launches: list[tuple[int, int]] = []  # (external id, CUPTI time)
        self._correlation = 0
        self._strings: dict[str, object] = {}

    def correlator(self, base: int) -> RecordingCorrelator:
        gpu = self

        class Launching(RecordingCorrelator):
            def push(self, external_id: int) -> None:
                super().push(external_id)
                gpu._launches.append((external_id, now_on_cupti_clock()))

        correlator = Launching(base)
        self.correlators.append(correlator)
        return correlator

    def take_buffers(self) -> list[ActivityBuffer]:
        launches, self._launches = self._launches, []
        builder = BufferBuilder(strings=self._strings)
        for external_id, at in launches:
            if external_id & ((1 << 24) - 1) == 0:  # the first layer's forward: the batch
                self._correlation += 1
                builder.api(self._correlation, at - 2_000, at - 1_900)
                builder.memcpy(1, self.COPY_BYTES, at - 1_500, at - 500,
                               correlation=self._correlation)
            self._correlation += 1
            builder.external(self._correlation, external_id).api(self._correlation, at, at + 500)
            builder.kernel(self.KERNEL, at + 1_000, at + 21_000, correlation=self._correlation)
        self.queue.append(builder.bytes())
        return super().take_buffers()


def install_simulated_gpu() -> None:
    """Make this process's probe trace a simulated GPU (call before enabling it)."""
    from dlprof_agent.probe import kernel_tracer

    kernel_tracer.BINDING_FACTORY = SimulatedGpu
    kernel_tracer.CUDA_CHECK = lambda: True


# --- libcupti ------------------------------------------------------------------------

SUCCESS = 0
ERROR_INVALID_PARAMETER = 1
ERROR_MAX_LIMIT_REACHED = 12
ERROR_QUEUE_EMPTY = 27
ERROR_MULTIPLE_SUBSCRIBERS = 39  # CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED
FLUSH_FORCED = 1  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED
# Kineto's TSC clock ticks per ns on the evidence's H100: its kernel totals came out
# 2.10x too long after torch.profiler had run (GPU evidence 2026-11-23, item 4).
KINETO_TSC_TICKS_PER_NS = 2.10


class _Buffer:
    """An activity buffer a client's request callback handed CUPTI."""

    def __init__(self, address: int, size: int, complete: Callable[..., Any]) -> None:
        self.address, self.size, self.used = address, size, 0
        self.complete = complete  # the completion callback in force when it was requested
        self.incomplete = 0  # records whose activity has not finished (end unknown)
        self.running: list[tuple[int, int]] = []  # (address of the end field, end)


class FakeCupti:
    """One process's CUPTI, on a simulated GPU. What the probe relies on:

    - Activity kinds are process-wide: one client's ``cuptiActivityDisable``
      turns a kind off for every client (cupti_activity.h: enable/disable
      "collection of a specific kind of activity record", no client argument).
    - One pair of buffer callbacks per process: ``cuptiActivityRegisterCallbacks``
      by another client replaces ours, and records go to its callbacks from then
      on (Kineto registers its own at every profiler start:
      pytorch/kineto CuptiActivityApi.cpp, enableCuptiActivities).
    - Buffers are handed back when full, and by ``cuptiActivityFlushAll``; the
      periodic flush (cuptiActivityFlushPeriod) "can return only those activity
      buffers which are full and have all the activity records completed"
      (CUPTI docs, and NVIDIA's forum answer "cuptiActivityFlushPeriod
      confusion"); a non-forced ``cuptiActivityFlushAll(0)`` returns partly
      filled buffers whose records are complete, a forced one (flag 1) every
      buffer, incomplete records (end 0) too. GPU evidence 2026-11-23, item 1:
      50 x 8 MiB copies never arrived under the periodic flush; they did with
      ``cuptiActivityFlushAll(0)`` at each drain.
    - One subscriber per process (CUDA 13.2 and earlier, CUPTI docs "Legacy
      Initialization"): a second ``cuptiSubscribe`` fails with
      CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED; Kineto keeps its
      subscriber after the profiler stops (evidence item 2).
    - A timestamp callback (``cuptiActivityRegisterTimestampCallback``) replaces
      CUPTI's clock (ns) in every record until another one, or NULL, is
      registered; Kineto registers its TSC clock at every GPU-tracing start and
      never unregisters it (kineto CuptiTimestamp.cpp; evidence item 4: 2.10x).
      NULL answers 1 (CUPTI_ERROR_INVALID_PARAMETER) and changes nothing: with it
      called at every open, the kernel totals after torch.profiler were still
      2.10x (GPU evidence 2026-11-26, gpu-tests.txt: 76.2 against 36.3 ms a step;
      one run on 2026-11-23 that looked right is not reproduced).
      ``cuptiGetTimestamp`` follows the registered clock too, as it did on the H100
      (GPU evidence 2026-11-26 run-2: the probe measured 2.10 ticks per ns from its
      rate at open); ``timestamp_follows_callback=False`` models a CUPTI that keeps
      it on its own clock, as CUPTI's documentation describes.
    """

    def __init__(self, *, version: str = "13.4", buffer_records: int | None = None,
                 now_ns: Callable[[], int] | None = None,
                 time_source: SteppedTime | None = None,
                 timestamp_follows_callback: bool = True) -> None:
        self.version = version
        self.layouts = LAYOUTS[version]
        self.enabled: set[int] = set()
        self.callbacks: tuple[Any, Any] | None = None  # (requested, completed)
        self.timestamp_callback: Callable[[int], int] | None = None  # ns -> its clock
        self.timestamp_follows_callback = timestamp_follows_callback
        self.flush_period_ms = 0
        self.subscribers: list[str] = []
        self.dropped = 0
        self.calls: list[str] = []
        # The time the probe beside it must read too (its perf_ns and sleep), if given.
        self.time_source = time_source
        self._now_ns = now_ns or (time_source.cupti_ns if time_source is not None else
                                  lambda: time.perf_counter_ns() + CUPTI_MINUS_PERF_NS)
        self._open: list[_Buffer] = []
        self._strings: dict[str, Any] = {}
        self._external: dict[int, list[tuple[int, int]]] = {}  # thread -> (kind, id)
        self._correlation = 0
        self._buffer_records = buffer_records  # a buffer smaller than asked: fills sooner

    # What the binding loads (``CuptiBinding(load=fake.load)``).

    def load(self, framework: str = "", framework_cuda: str | None = None
             ) -> tuple[dict[str, Any], str]:
        return {
            "cuptiActivityRegisterCallbacks": self._register_callbacks,
            "cuptiActivityGetNextRecord": self._get_next_record,
            "cuptiActivityGetNumDroppedRecords": self._get_dropped,
            "cuptiActivityEnable": self._enable,
            "cuptiActivityDisable": self._disable,
            "cuptiActivityFlushAll": self.flush_all,
            "cuptiActivityFlushPeriod": self._flush_period,
            "cuptiActivityPushExternalCorrelationId": self._push,
            "cuptiActivityPopExternalCorrelationId": self._pop,
            "cuptiGetTimestamp": self._get_timestamp,
            "cuptiGetResultString": lambda status, text: ERROR_INVALID_PARAMETER,
            "cuptiActivityRegisterTimestampCallback": self._register_timestamp_callback,
            "cuptiUnsubscribe": self.unsubscribe,
        }, self.version + ".0"

    def _register_callbacks(self, requested: Any, completed: Any) -> int:
        self.calls.append("register_callbacks")
        self.callbacks = (requested, completed)
        return SUCCESS

    def _enable(self, kind: int) -> int:
        self.enabled.add(kind)
        return SUCCESS

    def _disable(self, kind: int) -> int:
        self.enabled.discard(kind)
        return SUCCESS

    def _flush_period(self, milliseconds: int) -> int:
        self.flush_period_ms = milliseconds
        return SUCCESS

    def _register_timestamp_callback(self, callback: Any) -> int:
        self.calls.append("timestamp_callback" if callback else "timestamp_default")
        if not callback:  # refused, and the registered clock stays (see the class doc)
            return ERROR_INVALID_PARAMETER
        self.timestamp_callback = callback
        return SUCCESS

    def _get_timestamp(self, out: Any) -> int:
        now = self._now_ns()
        out._obj.value = self._stamp(now) if self.timestamp_follows_callback else now
        return SUCCESS

    def _get_dropped(self, context: Any, stream: int, out: Any) -> int:
        out._obj.value, self.dropped = self.dropped, 0
        return SUCCESS

    def _get_next_record(self, buffer: Any, valid: int, record: Any) -> int:
        """As cupti_activity.h documents it: the record after ``*record``."""
        address = record._obj.value
        kind = ctypes.c_int32.from_address(address).value
        size = self.layouts[kind].itemsize
        if address + size - buffer >= valid:
            return ERROR_MAX_LIMIT_REACHED
        record._obj.value = address + size
        return SUCCESS

    def _push(self, kind: int, external_id: int) -> int:
        self._external.setdefault(threading.get_ident(), []).append((kind, external_id))
        return SUCCESS

    def _pop(self, kind: int, last: Any) -> int:
        stack = self._external.get(threading.get_ident())
        if not stack:
            return ERROR_QUEUE_EMPTY
        stack.pop()
        return SUCCESS

    # Buffers.

    def _stamp(self, ns: int) -> int:
        return ns if self.timestamp_callback is None else int(self.timestamp_callback(ns))

    def _append(self, record: np.ndarray[Any, Any], *, running_end: int = 0) -> None:
        data = record.tobytes()
        buffer = self._open[-1] if self._open else None
        if buffer is not None and buffer.used + len(data) > buffer.size:
            self._hand_back(buffer)  # full: CUPTI hands it back and asks for another
            buffer = None
        if buffer is None:
            if self.callbacks is None:
                self.dropped += 1
                return
            address, size, _ = _request(self.callbacks[0])
            if self._buffer_records is not None:
                size = min(size, self._buffer_records * len(data))
            if not address or size < len(data):
                self.dropped += 1  # no buffer: CUPTI drops the record, and counts it
                return
            buffer = _Buffer(address, size, self.callbacks[1])
            self._open.append(buffer)
        ctypes.memmove(buffer.address + buffer.used, data, len(data))
        if running_end:
            buffer.incomplete += 1
            field = record.dtype.fields["end"][1]
            buffer.running.append((buffer.address + buffer.used + field, running_end))
        buffer.used += len(data)

    def _hand_back(self, buffer: _Buffer) -> None:
        self._open.remove(buffer)
        # The completion callback in force now: another client's, if it registered
        # its own since (one pair per process).
        completed = self.callbacks[1] if self.callbacks is not None else buffer.complete
        completed(None, 0, buffer.address, buffer.size, buffer.used)

    def flush_all(self, flag: int) -> int:
        self.calls.append(f"flush_all({flag})")
        for buffer in list(self._open):
            if buffer.used and (flag & FLUSH_FORCED or not buffer.incomplete):
                self._hand_back(buffer)
        return SUCCESS

    def periodic_flush(self) -> None:
        """CUPTI's worker thread, every flush period: full buffers only. Ours are
        handed back as soon as they fill, so nothing more is delivered here."""
        for buffer in list(self._open):
            if buffer.used + 8 > buffer.size and not buffer.incomplete:
                self._hand_back(buffer)

    # The simulated GPU.

    def _record(self, kind: int, **values: int) -> np.ndarray[Any, Any]:
        record = np.zeros(1, dtype=self.layouts[kind])
        record["kind"] = kind
        for key, value in values.items():
            record[key] = value
        return record

    def _launch_records(self, start_ns: int) -> int:
        """The launch's correlation id; its runtime API record and the external
        correlation records of the ids pushed on this thread, where enabled."""
        self._correlation += 1
        correlation = self._correlation
        for kind, external_id in self._external.get(threading.get_ident(), [])[-1:]:
            if 39 in self.enabled:
                self._append(self._record(39, external_kind=kind, external_id=external_id,
                                          correlation_id=correlation))
        if 5 in self.enabled:
            self._append(self._record(5, cbid=211, start=self._stamp(start_ns - 2_000),
                                      end=self._stamp(start_ns - 1_000),
                                      correlation_id=correlation))
        return correlation

    def kernel(self, name: str, duration_ns: int, *, start_ns: int | None = None,
               running: bool = False) -> None:
        """A kernel launched and run now (``running``: not finished yet)."""
        start = self._now_ns() if start_ns is None else start_ns
        correlation = self._launch_records(start)
        if 10 not in self.enabled:
            return
        if name not in self._strings:
            self._strings[name] = ctypes.create_string_buffer(name.encode())
        end = self._stamp(start + duration_ns)
        self._append(self._record(
            10, name=ctypes.addressof(self._strings[name]), start=self._stamp(start),
            end=0 if running else end, device_id=0, stream_id=7,
            correlation_id=correlation, context_id=1, grid_x=1, grid_y=1, grid_z=1,
            block_x=128, block_y=1, block_z=1), running_end=end if running else 0)

    def memcpy(self, copy_kind: int, nbytes: int, duration_ns: int) -> None:
        start = self._now_ns()
        correlation = self._launch_records(start)
        if 1 in self.enabled:
            self._append(self._record(1, copy_kind=copy_kind, bytes=nbytes,
                                      start=self._stamp(start),
                                      end=self._stamp(start + duration_ns), device_id=0,
                                      stream_id=7, correlation_id=correlation, src_kind=1,
                                      dst_kind=2))

    def finish_running(self) -> None:
        """The kernels still running have finished (their buffers may go back)."""
        for buffer in self._open:
            for address, end in buffer.running:
                ctypes.c_uint64.from_address(address).value = end
            buffer.incomplete, buffer.running = 0, []

    # Subscribers (the Callback API).

    def subscribe(self, name: str) -> int:
        if self.subscribers:
            return ERROR_MULTIPLE_SUBSCRIBERS
        self.subscribers.append(name)
        return SUCCESS

    def unsubscribe(self, handle: Any) -> int:
        if "dlprof-agent" in self.subscribers:
            self.subscribers.remove("dlprof-agent")
        return SUCCESS


def _request(callback: Any) -> tuple[int, int, int]:
    """Ask a client's request callback for a buffer, as CUPTI does."""
    buffer, size, records = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t()
    callback(ctypes.byref(buffer), ctypes.byref(size), ctypes.byref(records))
    return buffer.value or 0, size.value, records.value


class FakeKineto:
    """PyTorch's CUPTI client as pytorch/kineto does it (libkineto/src), for
    ``FakeCupti``. Prepare (CuptiActivityProfiler::configure -> enableGpuTracing):
    subscribe once (CuptiCallbackApi; on failure it logs "CUPTI initialization
    failed - CUDA profiler activities will be missing" and gets nothing, evidence
    item 3), register its TSC timestamp callback (configureCuptiTimestampSource),
    its buffer callbacks, and enable its kinds. Stop: a forced flush, its kinds
    off; the subscriber and the timestamp callback stay. A completed buffer it
    did not allocate is dropped, not read (CuptiActivityApi::bufferCompleted:
    "bufferCompleted called with unknown buffer")."""

    KINDS = (10, 1, 2, 5, 4, 39)

    def __init__(self, cupti: FakeCupti, *, use_tsc: bool = True) -> None:
        self.cupti = cupti
        self.use_tsc = use_tsc
        self.subscribed = False
        self.failed = False
        self.kernels: list[tuple[int, int]] = []  # (start, end) in ns, as it converts them
        self.copies: list[int] = []  # bytes
        self.foreign_buffers = 0
        self._buffers: dict[int, Any] = {}
        self._callbacks = (_REQUESTED_T(self._requested), _COMPLETED_T(self._completed))

    def _requested(self, buffer: Any, size: Any, max_records: Any) -> None:
        data = ctypes.create_string_buffer(1 << 16)
        address = ctypes.addressof(data)
        self._buffers[address] = data
        buffer[0], size[0], max_records[0] = address, 1 << 16, 0

    def _completed(self, context: Any, stream: int, buffer: Any, size: int, valid: int) -> None:
        if buffer not in self._buffers:
            self.foreign_buffers += 1
            return
        layouts = self.cupti.layouts
        offset = 0
        while offset < valid:
            kind = ctypes.c_int32.from_address(buffer + offset).value
            dtype = layouts[kind]
            record = np.frombuffer(ctypes.string_at(buffer + offset, dtype.itemsize),
                                   dtype=dtype)[0]
            if kind == 10:
                self.kernels.append((self._ns(int(record["start"])),
                                     self._ns(int(record["end"]))))
            elif kind == 1:
                self.copies.append(int(record["bytes"]))
            offset += dtype.itemsize
        del self._buffers[buffer]

    def _ns(self, timestamp: int) -> int:
        return round(timestamp / KINETO_TSC_TICKS_PER_NS) if self.use_tsc else timestamp

    def prepare(self) -> None:
        if not self.subscribed:
            self.subscribed = self.cupti.subscribe("<not provided>") == SUCCESS
            self.failed = not self.subscribed
        if self.failed:
            return
        if self.use_tsc:
            self.cupti._register_timestamp_callback(
                lambda ns: round(ns * KINETO_TSC_TICKS_PER_NS))
        self.cupti._register_callbacks(*self._callbacks)
        for kind in self.KINDS:
            self.cupti._enable(kind)

    def stop(self) -> None:
        if self.failed:
            return
        self.cupti.flush_all(FLUSH_FORCED)
        for kind in self.KINDS:
            self.cupti._disable(kind)


_REQUESTED_T = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p),
                                ctypes.POINTER(ctypes.c_size_t),
                                ctypes.POINTER(ctypes.c_size_t))
_COMPLETED_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p,
                                ctypes.c_size_t, ctypes.c_size_t)
