"""The probe's only door to CUPTI: cupti-python, and ctypes on the libcupti it loads.

Why not cupti-python alone: its ``activity_register_callbacks`` hands the
buffer-completed callback a list holding one Python object per activity
record. At tens of thousands of kernels per second that per-record Python work
is the bottleneck PyTorch's own experimental CUPTI monitor ran into, and it
would sit on the job's GIL. So the two buffer callbacks are ours, registered
through ctypes on the very libcupti cupti-python loaded (found in
/proc/self/maps and opened with RTLD_NOLOAD, so a second copy is never loaded):
the request callback hands CUPTI a malloc'd buffer from a bounded pool, the
completion callback queues (address, valid bytes). Neither looks at a record.
The probe thread later views each buffer as numpy arrays in place and decodes
it in bulk (``kernel_records``), then gives it back to the pool.

cupti-python does what only it does well: it finds and loads the libcupti of its
CUDA major (or reuses the one the framework loaded). Every call goes through
ctypes on that library, because a ctypes call releases the GIL: CUPTI's
worker thread may sit in one of our callbacks waiting for the GIL while holding
a lock that, say, ``cuptiActivityFlushAll`` or a push of an external
correlation id needs; a call made with the GIL held could then deadlock the
job. The callbacks themselves take the GIL (as cupti-python's own do) and hold
it for a few list operations. ``cuptiActivityGetNextRecord`` tells the size of
a record kind the first time one is seen, so the layouts of newer CUPTI
versions decode too.

Rules kept here:

- No subscriber. The Activity API needs none, and a subscription is a claim
  another client trips over: Kineto (torch.profiler) asks for one when its
  profiler is prepared and fails with CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED
  while one is held, and it keeps its own after the profiler stops, so ours
  could never be had again (GPU evidence 2026-11-23, items 2 and 3; CUPTI
  documents one subscriber per process up to CUDA 13.2, "Legacy Initialization").
- Activity kinds, the buffer callbacks and the timestamp source are
  process-wide in CUPTI: the last ``cuptiActivityRegisterCallbacks`` wins, so
  ``open`` registers ours again every time tracing (re)starts.
- CUPTI's periodic flush hands over only full buffers ("periodic flush can
  return only those activity buffers which are full and have all the activity
  records completed", cuptiActivityFlushPeriod), which a quiet job never fills;
  a non-forced ``cuptiActivityFlushAll(0)`` hands over the partly filled ones
  whose records are complete, so the tracer calls ``flush`` on its drain cadence.
- Flushes are not forced (a forced flush hands over kernels still running,
  with end 0, which the aggregator leaves out), but once: when we stand aside
  for another client, so that none of our buffers is left in CUPTI to be filled
  with its records and handed to its callbacks (Kineto drops a buffer it did not
  allocate: "bufferCompleted called with unknown buffer").
- ``cuptiFinalize`` is never called (it would tear CUPTI down under any other
  client in the process): we disable our kinds instead.

The C callbacks catch everything. They and their buffer pool live for the whole
process: CUPTI may still hold a buffer, and call back, after we stopped.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import importlib.metadata
import importlib.util
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dlprof_agent.errors import CuptiUnavailable
from dlprof_agent.probe.cupti_versions import (
    cuda_mismatch,
    framework_cupti_version,
    install_command,
    loaded_libcupti,
)

# Any below stands for ctypes' objects: library handles, C function pointers,
# pointers handed to the callbacks, out-parameters.
BUFFER_BYTES = 4 << 20
MAX_BUFFERS = 16  # 64 MiB at most; with none free CUPTI drops records, and counts them
FLUSH_PERIOD_MS = 500
EXTERNAL_KIND_CUSTOM2 = 5  # CUpti_ExternalCorrelationKind; Kineto uses CUSTOM0 and CUSTOM1
RESULT_MAX_LIMIT_REACHED = 12  # CUPTI_ERROR_MAX_LIMIT_REACHED: no record after this one
FLUSH_NOT_FORCED = 0  # cuptiActivityFlushAll's flag: only buffers of completed records
FLUSH_FORCED = 1  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED: every buffer, running work included


@dataclass(frozen=True)
class ActivityBuffer:
    """A completed activity buffer: ``data`` supports the buffer protocol and
    holds at least ``valid_bytes``; ``address`` is 0 for a synthetic one."""

    data: Any
    valid_bytes: int
    address: int = 0


class _BufferPool:
    """Buffers for CUPTI, from libc's malloc so that any CUPTI client may free one
    it is handed by mistake. Touched by CUPTI's threads through the callbacks."""

    def __init__(self, libc: Any) -> None:
        self._malloc = libc.malloc
        self._malloc.restype = ctypes.c_void_p
        self._malloc.argtypes = [ctypes.c_size_t]
        self._free = libc.free
        self._free.restype = None
        self._free.argtypes = [ctypes.c_void_p]
        self.buffer_bytes = BUFFER_BYTES
        self.limit = MAX_BUFFERS
        self.free: list[int] = []
        self.owned: set[int] = set()
        self.completed: collections.deque[tuple[int, int]] = collections.deque()
        self.dropped_records = 0
        self.refused_requests = 0
        self.foreign_buffers = 0
        self.callback_errors = 0
        self.get_dropped: Any = None  # cuptiActivityGetNumDroppedRecords, once loaded

    def requested(self, buffer: Any, size: Any, max_records: Any) -> None:
        try:
            address = self.free.pop() if self.free else 0
            if not address and len(self.owned) < self.limit:
                address = self._malloc(self.buffer_bytes) or 0
                if address:
                    self.owned.add(address)
            if not address:
                self.refused_requests += 1  # CUPTI drops records and counts them
            buffer[0] = address or None
            size[0] = self.buffer_bytes if address else 0
            max_records[0] = 0  # as many as fit
        except BaseException:
            self.callback_errors += 1
            with contextlib.suppress(BaseException):
                buffer[0] = None
                size[0] = 0

    def completed_callback(self, context: Any, stream: int, buffer: Any, size: int,
                           valid: int) -> None:
        try:
            if buffer in self.owned:
                self.completed.append((int(buffer), int(valid)))
            elif buffer:
                self.foreign_buffers += 1  # another client's: leave it alone
            if self.get_dropped is not None:
                dropped = ctypes.c_size_t(0)
                if self.get_dropped(context, stream, ctypes.byref(dropped)) == 0:
                    self.dropped_records += dropped.value
        except BaseException:
            self.callback_errors += 1

    def release(self, address: int) -> None:
        if address in self.owned:
            self.free.append(address)

    def trim(self) -> None:
        """Free the idle buffers: tracing stopped. Those CUPTI holds stay owned."""
        while self.free:
            address = self.free.pop()
            self.owned.discard(address)
            self._free(address)

    def forget_outstanding(self) -> None:
        """Another client tore CUPTI down while it held our buffers: they will not
        come back, so stop counting them against the limit (they leak)."""
        self.owned = set(self.free) | {address for address, _ in self.completed}


_REQUESTED = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p),
                              ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t))
_COMPLETED = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p,
                              ctypes.c_size_t, ctypes.c_size_t)
# Process-wide, never collected: CUPTI keeps these function pointers.
_pool: _BufferPool | None = None
_callbacks: tuple[Any, Any] | None = None


class Correlator:
    """Pushes and pops the layer hooks' external correlation ids (CUSTOM2) on the
    calling thread. Errors are counted, never raised: the hooks run in the job."""

    __slots__ = ("_last", "_pop", "_push", "base", "failures")

    def __init__(self, push: Any, pop: Any, base: int) -> None:
        self._push, self._pop = push, pop
        self._last = ctypes.c_uint64(0)  # pop's out-parameter; its value is not used
        self.base = base
        self.failures = 0

    def push(self, external_id: int) -> None:
        try:
            if self._push(EXTERNAL_KIND_CUSTOM2, external_id):
                self.failures += 1
        except Exception:
            self.failures += 1

    def pop(self) -> None:
        try:
            if self._pop(EXTERNAL_KIND_CUSTOM2, ctypes.byref(self._last)):
                self.failures += 1
        except Exception:
            self.failures += 1


def _c_functions(library: Any) -> dict[str, Any]:
    """The CUPTI functions called through ctypes, typed. A ctypes call releases the
    GIL: CUPTI's worker thread, inside one of our callbacks, may be waiting for it
    while it holds a lock such a call needs."""
    signatures: dict[str, list[Any]] = {
        "cuptiActivityRegisterCallbacks": [_REQUESTED, _COMPLETED],
        "cuptiActivityGetNextRecord": [ctypes.c_void_p, ctypes.c_size_t,
                                       ctypes.POINTER(ctypes.c_void_p)],
        "cuptiActivityGetNumDroppedRecords": [ctypes.c_void_p, ctypes.c_uint32,
                                              ctypes.POINTER(ctypes.c_size_t)],
        "cuptiActivityEnable": [ctypes.c_int],
        "cuptiActivityDisable": [ctypes.c_int],
        "cuptiActivityFlushAll": [ctypes.c_uint32],
        "cuptiActivityFlushPeriod": [ctypes.c_uint32],
        "cuptiActivityPushExternalCorrelationId": [ctypes.c_int, ctypes.c_uint64],
        "cuptiActivityPopExternalCorrelationId": [ctypes.c_int,
                                                  ctypes.POINTER(ctypes.c_uint64)],
        "cuptiGetTimestamp": [ctypes.POINTER(ctypes.c_uint64)],
        "cuptiGetResultString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        # Since CUPTI 11.6; NULL puts CUPTI's own clock (ns) back.
        "cuptiActivityRegisterTimestampCallback": [ctypes.c_void_p],
    }
    optional = {"cuptiActivityRegisterTimestampCallback"}
    functions = {}
    for name, argtypes in signatures.items():
        try:
            function = getattr(library, name)
        except AttributeError:
            if name in optional:
                continue
            raise
        function.restype = ctypes.c_int  # CUptiResult
        function.argtypes = argtypes
        functions[name] = function
    return functions


def load_libcupti(framework: str, framework_cuda: str | None) -> tuple[dict[str, Any], str]:
    """The CUPTI functions of the libcupti cupti-python loads (or the one the
    framework loaded), and cupti-python's version. Raises CuptiUnavailable."""
    if importlib.util.find_spec("cupti") is None:
        version = framework_cupti_version(framework_cuda)
        known = f" (the job's CUPTI is {version})" if version.count(".") >= 2 else ""
        raise CuptiUnavailable("cupti-python not installed in the job's environment: "
                               f"{install_command(version)}{known}")
    try:
        version = importlib.metadata.version("cupti-python")
    except importlib.metadata.PackageNotFoundError:
        version = "0"
    mismatch = cuda_mismatch(version, framework or "the job", framework_cuda,
                             framework_cupti_version(framework_cuda))
    loaded = loaded_libcupti()
    major = version.split(".")[0]
    if not mismatch and loaded and not any(f".so.{major}" in path for path in loaded):
        # The framework's profiler loaded a CUPTI of another major: two would clash.
        mismatch = (f"the job already loaded {os.path.basename(loaded[0])}, and "
                    f"cupti-python {version} is for CUDA {major}: install the "
                    "cupti-python of that major")
    if mismatch:
        raise CuptiUnavailable(mismatch)
    try:
        # cupti-python finds and loads the libcupti of its major (or takes the one
        # the framework loaded).
        from cupti import cupti  # noqa: F401
    except Exception as error:
        raise CuptiUnavailable(f"cupti-python {version} does not load: "
                               f"{type(error).__name__}: {error}"[:200]) from None
    libraries = loaded_libcupti()
    if len(libraries) != 1:
        raise CuptiUnavailable(
            "no libcupti loaded" if not libraries else
            f"two CUPTI libraries in the process ({', '.join(libraries)})")
    try:
        library = ctypes.CDLL(libraries[0], mode=os.RTLD_NOW | os.RTLD_NOLOAD)
        return _c_functions(library), version
    except Exception as error:
        raise CuptiUnavailable(f"CUPTI setup failed: {type(error).__name__}: {error}"
                               [:200]) from None


class CuptiBinding:
    """CUPTI's Activity API for one tracer run: open, enable, take buffers, close.
    ``load`` gives the CUPTI functions (``load_libcupti``; a test's fake CUPTI)."""

    def __init__(self, load: Callable[[str, str | None], tuple[dict[str, Any], str]]
                 | None = None) -> None:
        self._load = load or load_libcupti
        self._c: dict[str, Any] = {}
        self._enabled: list[int] = []
        self.version = ""
        self.flushes = 0
        self.flush_seconds = 0.0  # time spent in cuptiActivityFlushAll, measured
        self.clock_reset_result: int | None = None  # what CUPTI answered to the reset

    def open(self, framework: str = "", framework_cuda: str | None = None) -> None:
        """Make CUPTI deliver our kinds to our callbacks, on its own clock.
        Raises CuptiUnavailable. Holds no subscriber (see the module doc)."""
        global _pool, _callbacks  # noqa: PLW0603 - one pool per process, as CUPTI is one
        self._c, self.version = self._load(framework, framework_cuda)
        try:
            if _pool is None:
                _pool = _BufferPool(ctypes.CDLL(None))
            else:
                _pool.forget_outstanding()
                while _pool.completed:  # left from an earlier run: recycle unread
                    _pool.release(_pool.completed.popleft()[0])
            _pool.get_dropped = self._c["cuptiActivityGetNumDroppedRecords"]
            if _callbacks is None:
                _callbacks = (_REQUESTED(_pool.requested), _COMPLETED(_pool.completed_callback))
            # Another client (Kineto) may have registered its own since we last did.
            self._check("cuptiActivityRegisterCallbacks", *_callbacks)
            self._check("cuptiActivityFlushPeriod", FLUSH_PERIOD_MS)
            self._restore_clock()
        except CuptiUnavailable:
            self.close()
            raise
        except Exception as error:
            self.close()
            raise CuptiUnavailable(f"CUPTI setup failed: {type(error).__name__}: {error}"
                                   [:200]) from None

    def _restore_clock(self) -> None:
        """Put CUPTI's own timestamps (ns) back. Kineto registers a timestamp
        callback (its TSC clock, on by default: 2.10 ticks per ns on the H100 of the
        evidence) and leaves it registered after the profiler stops. It registers
        it again each time its GPU tracing is enabled, i.e. at every profiler start
        (pytorch/kineto CuptiActivityProfiler::enableGpuTracing calls
        configureCuptiTimestampSource, and did the same inline since the TSC clock
        came in, 2024), so undoing it when we (re)start leaves the next
        torch.profiler session its own clock. We only ever (re)start with no other
        profiler in the job."""
        register = self._c.get("cuptiActivityRegisterTimestampCallback")
        # Its answer is kept, never acted on: on the evidence's H100 (CUPTI 13.0) the
        # call answered 1 (CUPTI_ERROR_INVALID_PARAMETER), and the kernel totals were
        # right again all the same. The GPU tests compare totals after torch.profiler ran.
        self.clock_reset_result = register(None) if register is not None else None

    def _check(self, function: str, *args: Any) -> None:
        status = self._c[function](*args)
        if status:
            raise CuptiUnavailable(f"{function} failed: {self._result(status)}")

    def _result(self, status: int) -> str:
        text = ctypes.c_char_p()
        with contextlib.suppress(Exception):
            if self._c["cuptiGetResultString"](status, ctypes.byref(text)) == 0 and text.value:
                return text.value.decode(errors="replace")
        return f"CUPTI error {status}"

    @property
    def enabled(self) -> tuple[int, ...]:
        return tuple(self._enabled)

    def enable(self, kinds: list[int]) -> None:
        for kind in kinds:
            if kind in self._enabled:
                continue
            status = self._c["cuptiActivityEnable"](kind)
            if status:
                self.close()
                raise CuptiUnavailable(f"CUPTI cannot trace activity kind {kind}: "
                                       f"{self._result(status)}")
            self._enabled.append(kind)

    def disable(self, kinds: list[int]) -> None:
        for kind in kinds:
            if kind in self._enabled:
                self._enabled.remove(kind)
                self._c["cuptiActivityDisable"](kind)

    def flush(self, *, forced: bool = False) -> None:
        """Hand over the completed records now; forced only to stand aside (see the
        module doc)."""
        if self._c:
            started = time.perf_counter()
            self._c["cuptiActivityFlushAll"](FLUSH_FORCED if forced else FLUSH_NOT_FORCED)
            self.flush_seconds += time.perf_counter() - started
            self.flushes += 1

    def take_buffers(self) -> list[ActivityBuffer]:
        pool = _pool
        taken: list[ActivityBuffer] = []
        while pool is not None and pool.completed:
            address, valid = pool.completed.popleft()
            taken.append(ActivityBuffer((ctypes.c_char * max(valid, 1)).from_address(address),
                                        valid, address))
        return taken

    def release(self, buffer: ActivityBuffer) -> None:
        if _pool is not None and buffer.address:
            _pool.release(buffer.address)

    def record_size(self, buffer: ActivityBuffer, offset: int) -> int | None:
        """The size of the record at ``offset``, from CUPTI's own record walk."""
        if not self._c or not buffer.address:
            return None
        record = ctypes.c_void_p(buffer.address + offset)
        status = self._c["cuptiActivityGetNextRecord"](buffer.address, buffer.valid_bytes,
                                                       ctypes.byref(record))
        if status == RESULT_MAX_LIMIT_REACHED:
            return buffer.valid_bytes - offset
        if status != 0 or not record.value:
            return None
        return int(record.value) - buffer.address - offset

    def counters(self) -> dict[str, int]:
        pool = _pool
        if pool is None:
            return {}
        return {"dropped_records": pool.dropped_records,
                "refused_buffers": pool.refused_requests,
                "callback_errors": pool.callback_errors}

    def timestamp_ns(self) -> int:
        value = ctypes.c_uint64(0)
        self._check("cuptiGetTimestamp", ctypes.byref(value))
        return int(value.value)

    def correlator(self, base: int) -> Correlator:
        return Correlator(self._c["cuptiActivityPushExternalCorrelationId"],
                          self._c["cuptiActivityPopExternalCorrelationId"], base)

    def close(self, *, forced: bool = False) -> None:
        """Give CUPTI back: our kinds off, then our last records flushed to us
        (``forced``: every buffer of ours, before another client takes over)."""
        if self._c:
            for kind in reversed(self._enabled):
                with contextlib.suppress(Exception):
                    self._c["cuptiActivityDisable"](kind)
            with contextlib.suppress(Exception):
                self.flush(forced=forced)
        self._enabled = []

    def abandon(self) -> None:
        """Another client is already using CUPTI: its kinds are ours too (CUPTI's
        kinds are process-wide), so leave them, and its buffers, alone."""
        self._enabled = []

    @staticmethod
    def trim() -> None:
        if _pool is not None:
            _pool.trim()
