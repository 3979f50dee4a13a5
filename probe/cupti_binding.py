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
CUDA major (or reuses the one the framework loaded), and subscribes under our
name, which on CUPTI 13 also tells who else holds CUPTI. Every other call goes
through ctypes on that library, because a ctypes call releases the GIL: CUPTI's
worker thread may sit in one of our callbacks waiting for the GIL while holding
a lock that, say, ``cuptiActivityFlushAll`` or a push of an external
correlation id needs; a call made with the GIL held could then deadlock the
job. The callbacks themselves take the GIL (as cupti-python's own do) and hold
it for a few list operations. ``cuptiActivityGetNextRecord`` tells the size of
a record kind the first time one is seen, so the layouts of newer CUPTI
versions decode too.

Rules kept here: continuous mode only ever flushes without forcing (a forced
flush hands over kernels still running, with end 0); ``cuptiFinalize`` is never
called (it would tear CUPTI down under any other client in the process): we
unsubscribe and disable our kinds instead. The C callbacks catch everything.
They and their buffer pool live for the whole process: CUPTI may still hold a
buffer, and call back, after we stopped.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Any

SUBSCRIBER_NAME = "dlprof-agent"
BUFFER_BYTES = 4 << 20
MAX_BUFFERS = 16  # 64 MiB at most; with none free CUPTI drops records, and counts them
FLUSH_PERIOD_MS = 500
EXTERNAL_KIND_CUSTOM2 = 5  # CUpti_ExternalCorrelationKind; Kineto uses CUSTOM0 and CUSTOM1
RESULT_MAX_LIMIT_REACHED = 12  # CUPTI_ERROR_MAX_LIMIT_REACHED: no record after this one
RESULT_MULTIPLE_SUBSCRIBERS = 39  # CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED


class CuptiUnavailable(Exception):
    """CUPTI cannot be used in this process; ``reason`` says why in a few words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CuptiBusy(CuptiUnavailable):
    """Another CUPTI client holds the process; ``reason`` names it where known."""


@dataclass(frozen=True)
class ActivityBuffer:
    """A completed activity buffer: ``data`` supports the buffer protocol and
    holds at least ``valid_bytes``; ``address`` is 0 for a synthetic one."""

    data: Any
    valid_bytes: int
    address: int = 0


def cuda_mismatch(cupti_python_version: str, framework: str, framework_cuda: str | None
                  ) -> str | None:
    """Why cupti-python of this version must not be loaded beside a framework built
    for ``framework_cuda`` (one CUPTI per process, of the framework's CUDA major)."""
    if not framework_cuda:
        return None
    ours = cupti_python_version.split(".", maxsplit=1)[0]
    theirs = framework_cuda.split(".")[0]
    if ours == theirs:
        return None
    return (f"cupti-python {cupti_python_version} is for CUDA {ours} but {framework} uses "
            f"CUDA {framework_cuda}: pip install 'cupti-python=={theirs}.*' in the job's "
            "environment")


def holder_hint(environ: dict[str, str]) -> str:
    """Who else may hold CUPTI, for CUPTI versions that do not say."""
    injection = environ.get("CUDA_INJECTION64_PATH", "")
    if "ToolsInjection" in injection or environ.get("NSYS_PROFILING_SESSION_ID"):
        return "Nsight Systems"
    if "ncu" in injection.lower() or "nsight-compute" in injection.lower():
        return "Nsight Compute"
    if injection:
        return f"the injection library {os.path.basename(injection)}"
    return "another CUPTI client (torch.profiler, Nsight, TensorFlow's profiler, DCGM)"


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


def _ignore_callback(*args: Any) -> None:
    """The subscription is only a claim on CUPTI; no callback domain is enabled."""


def _loaded_libcupti() -> list[str]:
    paths = set()
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rstrip("\n").split(maxsplit=5)[-1]
            if "/libcupti.so" in path:
                paths.add(os.path.realpath(path))
    return sorted(paths)


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
        "cuptiUnsubscribe": [ctypes.c_void_p],
    }
    functions = {}
    for name, argtypes in signatures.items():
        function = getattr(library, name)
        function.restype = ctypes.c_int  # CUptiResult
        function.argtypes = argtypes
        functions[name] = function
    return functions


class CuptiBinding:
    """CUPTI's Activity API for one tracer run: open, enable, take buffers, close."""

    def __init__(self) -> None:
        self._c: dict[str, Any] = {}
        self._subscriber: int | None = None
        self._enabled: list[int] = []
        self.version = ""

    def open(self, framework: str = "", framework_cuda: str | None = None) -> None:
        """Claim CUPTI for this process. Raises CuptiBusy or CuptiUnavailable."""
        global _pool, _callbacks  # noqa: PLW0603 - one pool per process, as CUPTI is one
        if importlib.util.find_spec("cupti") is None:
            raise CuptiUnavailable("cupti-python not installed in the job's environment "
                                   "(pip install cupti-python)")
        try:
            version = importlib.metadata.version("cupti-python")
        except importlib.metadata.PackageNotFoundError:
            version = "0"
        mismatch = cuda_mismatch(version, framework or "the job", framework_cuda)
        loaded = _loaded_libcupti()
        major = version.split(".")[0]
        if not mismatch and loaded and not any(f".so.{major}" in path for path in loaded):
            # The framework's profiler loaded a CUPTI of another major: two would clash.
            mismatch = (f"the job already loaded {os.path.basename(loaded[0])}, and "
                        f"cupti-python {version} is for CUDA {major}: install the "
                        "cupti-python of that major")
        if mismatch:
            raise CuptiUnavailable(mismatch)
        self.version = version
        try:
            # cupti-python finds and loads the libcupti of its major (or takes the one
            # the framework loaded); it subscribes under our name below.
            from cupti import cupti
        except Exception as error:
            raise CuptiUnavailable(f"cupti-python {version} does not load: "
                                   f"{type(error).__name__}: {error}"[:200]) from None
        self._subscribe(cupti)
        try:
            libraries = _loaded_libcupti()
            if len(libraries) != 1:
                raise CuptiUnavailable(
                    "no libcupti loaded" if not libraries else
                    f"two CUPTI libraries in the process ({', '.join(libraries)})")
            library = ctypes.CDLL(libraries[0], mode=os.RTLD_NOW | os.RTLD_NOLOAD)
            self._c = _c_functions(library)
            if _pool is None:
                _pool = _BufferPool(ctypes.CDLL(None))
            else:
                _pool.forget_outstanding()
                while _pool.completed:  # left from an earlier run: recycle unread
                    _pool.release(_pool.completed.popleft()[0])
            _pool.get_dropped = self._c["cuptiActivityGetNumDroppedRecords"]
            if _callbacks is None:
                _callbacks = (_REQUESTED(_pool.requested), _COMPLETED(_pool.completed_callback))
            self._check("cuptiActivityRegisterCallbacks", *_callbacks)
            self._check("cuptiActivityFlushPeriod", FLUSH_PERIOD_MS)
        except CuptiUnavailable:
            self.close()
            raise
        except Exception as error:
            self.close()
            raise CuptiUnavailable(f"CUPTI setup failed: {type(error).__name__}: {error}"
                                   [:200]) from None

    def _subscribe(self, cupti: Any) -> None:
        params = None
        try:
            if hasattr(cupti, "subscribe_v2"):  # CUPTI 13: names us, and tells who else holds it
                params = cupti.SubscriberParams()
                params.struct_size = cupti.SUBSCRIBER_PARAMS_SIZE
                params.subscriber_name = SUBSCRIBER_NAME
                self._subscriber = int(cupti.subscribe_v2(_ignore_callback, None, params.ptr))
            else:
                self._subscriber = int(cupti.subscribe(_ignore_callback, None))
        except Exception as error:
            status = getattr(error, "status", None)
            if status == RESULT_MULTIPLE_SUBSCRIBERS:
                holder = ""
                with contextlib.suppress(Exception):
                    holder = str(params.old_subscriber_name) if params is not None else ""
                raise CuptiBusy(f"CUPTI is held by {holder or holder_hint(dict(os.environ))}"
                                ) from None
            name = ""
            with contextlib.suppress(Exception):
                name = str(cupti.Result(status).name)
            raise CuptiUnavailable(f"CUPTI refused to start: {name or type(error).__name__}: "
                                   f"{error}"[:200]) from None

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

    def flush(self) -> None:
        """Hand over the completed records now; never forced (see the module doc)."""
        if self._c:
            self._c["cuptiActivityFlushAll"](0)

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

    def close(self) -> None:
        """Give CUPTI back: our kinds off, the last records flushed, unsubscribed."""
        if self._c:
            for kind in reversed(self._enabled):
                with contextlib.suppress(Exception):
                    self._c["cuptiActivityDisable"](kind)
            with contextlib.suppress(Exception):
                self.flush()
        self._enabled = []
        self._unsubscribe()

    def abandon(self) -> None:
        """Another client took CUPTI over: leave its kinds and buffers alone."""
        self._enabled = []
        self._unsubscribe()

    def _unsubscribe(self) -> None:
        subscriber, self._subscriber = self._subscriber, None
        if subscriber is None:
            return
        with contextlib.suppress(Exception):
            if self._c:
                self._c["cuptiUnsubscribe"](subscriber)
            else:  # failed before ctypes was set up: cupti-python's own call then
                from cupti import cupti

                cupti.unsubscribe(subscriber)

    @staticmethod
    def trim() -> None:
        if _pool is not None:
            _pool.trim()


def framework_cuda() -> tuple[str, str | None]:
    """The framework in use and the CUDA version it was built for."""
    torch = sys.modules.get("torch")
    version = getattr(getattr(torch, "version", None), "cuda", None)
    if version:
        return "torch", str(version)
    tensorflow = sys.modules.get("tensorflow")
    if tensorflow is not None:
        with contextlib.suppress(Exception):
            info = tensorflow.sysconfig.get_build_info()
            if info.get("cuda_version"):
                return "tensorflow", str(info["cuda_version"])
    return "", None
