"""CUPTI activity buffers, decoded in bulk and aggregated into bounded totals.

A completed CUPTI activity buffer is a run of packed records of different kinds
and sizes, each starting with its ``CUpti_ActivityKind`` as an int32. Nothing
here creates a Python object per record:

1. ``RecordSplitter`` finds where each record starts. One compiled regular
   expression matches any known record (its kind's four bytes, then the rest of
   its size); ``findall`` walks the buffer in C and returns the first byte of
   each record, i.e. the sequence of kinds. A cumulative sum of their sizes
   gives every record's offset, and a check of the kind at each offset proves
   the walk stayed in step. A kind of unknown size stops the walk there; its
   size is asked of CUPTI (``learn``) and the walk goes on.
2. ``decode`` gathers each field it needs as one numpy array per kind, through
   views of the buffer as uint8/uint32/uint64.
3. ``KernelAggregator`` folds a batch into per-(kernel, device) launches and
   seconds, a duration histogram per device, memcpy bytes and seconds per
   direction, CUPTI's overhead, and kernel time per layer (through the
   external correlation records the layer hooks cause), with ``np.bincount``.

Record layouts are those of CUPTI 12.8 and 13.4, read from cupti-python's own
numpy dtypes (``cupti.activity_kernel13_dtype`` and friends; 12.8 names them
``c_upti_activity_kernel9_dtype``): CUpti_ActivityKernel9..13,
CUpti_ActivityMemcpy6/7, CUpti_ActivityMemset4/5, CUpti_ActivityOverhead3,
CUpti_ActivityExternalCorrelation and CUpti_ActivityAPI. Every field read here
has the same offset in all of them; only the record sizes differ, and the
tracer learns those from CUPTI at run time (``cuptiActivityGetNextRecord``),
so a newer CUPTI with longer records decodes too. ``RECORD_SIZES`` holds the
sizes of both versions, for tests and the benchmark.

This module runs inside the training process, on the probe's thread, and is
imported only once kernel tracing starts: numpy (a dependency of cupti-python)
is not loaded into a job before that.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import re
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

# CUpti_ActivityKind values (cupti_activity.h; stable across versions).
KIND_MEMCPY = 1
KIND_MEMSET = 2
KIND_DRIVER = 4
KIND_RUNTIME = 5
KIND_CONCURRENT_KERNEL = 10
KIND_OVERHEAD = 17
KIND_EXTERNAL_CORRELATION = 39

# CUpti_ExternalCorrelationKind. Kineto (torch.profiler) pushes CUSTOM0 and
# CUSTOM1; the layer hooks push CUSTOM2, so neither reads the other's ids.
EXTERNAL_KIND_CUSTOM2 = 5

# Record sizes in bytes, per CUPTI version. The tracer learns the real ones from
# CUPTI; these serve tests and the benchmark.
RECORD_SIZES: dict[str, dict[int, int]] = {
    "12.8": {KIND_CONCURRENT_KERNEL: 208,  # CUpti_ActivityKernel9
             KIND_MEMCPY: 96,  # CUpti_ActivityMemcpy6
             KIND_MEMSET: 88,  # CUpti_ActivityMemset4
             KIND_OVERHEAD: 56,  # CUpti_ActivityOverhead3
             KIND_EXTERNAL_CORRELATION: 24,  # CUpti_ActivityExternalCorrelation
             KIND_RUNTIME: 40, KIND_DRIVER: 40},  # CUpti_ActivityAPI
    "13.4": {KIND_CONCURRENT_KERNEL: 248,  # CUpti_ActivityKernel13
             KIND_MEMCPY: 112,  # CUpti_ActivityMemcpy7
             KIND_MEMSET: 104,  # CUpti_ActivityMemset5
             KIND_OVERHEAD: 56,
             KIND_EXTERNAL_CORRELATION: 24,
             KIND_RUNTIME: 40, KIND_DRIVER: 40},
}

# Byte offsets of the fields read, identical in every version above.
KERNEL_START, KERNEL_END, KERNEL_DEVICE, KERNEL_STREAM = 16, 24, 40, 48
KERNEL_CORRELATION, KERNEL_NAME = 92, 104  # uint32, const char*
COPY_KIND, COPY_BYTES, COPY_START, COPY_END = 4, 8, 16, 24  # uint8, uint64, ...
COPY_DEVICE, COPY_STREAM, COPY_CORRELATION = 32, 40, 44  # memset shares these from 8 on
OVERHEAD_KIND, OVERHEAD_START, OVERHEAD_END = 4, 24, 32
EXTERNAL_KIND, EXTERNAL_ID, EXTERNAL_CORRELATION = 4, 8, 16
API_START, API_CORRELATION = 8, 32  # CUpti_ActivityAPI

# CUpti_ActivityMemcpyKind -> the direction label: arrays count as device memory.
MEMCPY_KINDS = ("other", "h2d", "d2h", "h2d", "d2h", "d2d", "d2d", "d2d", "d2d", "h2h", "p2p")
MEMCPY_LABELS = ("h2d", "d2h", "d2d", "p2p", "h2h", "other")

# Upper bounds in seconds: kernels run from about a microsecond to many milliseconds.
DURATION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3,
                    2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
DEFAULT_MAX_KERNELS = 200
OTHER = "other"
MEMSET_NAME = "[memset]"  # memsets run on the GPU like kernels, as in Nsight's summaries
MAX_NAME_CHARS = 160
MAX_FULL_NAMES = 20_000  # distinct kernel symbols remembered; more is a pathological job
MAX_DEVICES = 64
MAX_CORRELATIONS = 1 << 20  # external correlation entries kept for a late kernel record
WEIGHT_SHIFT = 32  # external ids: the weight of a timed step sits above this bit
MAX_KIND = 128  # CUpti_ActivityKind values are below this (60 kinds in CUPTI 13)

U8 = npt.NDArray[np.uint8]
U32 = npt.NDArray[np.uint32]
U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]


class RecordSplitter:
    """Finds the kind and offset of every record in a buffer, in C."""

    def __init__(self, sizes: Mapping[int, int] | None = None) -> None:
        self.sizes: dict[int, int] = dict(sizes or {})
        self._compile()

    def _compile(self) -> None:
        # Kernels first: they are most of the records, and the first alternative wins fastest.
        order = sorted(self.sizes, key=lambda kind: kind != KIND_CONCURRENT_KERNEL)
        alternatives = [re.escape(struct.pack("<i", kind)) + b".{%d}" % (self.sizes[kind] - 4)
                        for kind in order if 0 < kind < 256]
        # The lookahead captures each record's first byte (its kind, < 256): findall
        # then returns one-byte bytes objects, which CPython shares, not allocates.
        self._pattern = (re.compile(b"(?=(.))(?:" + b"|".join(alternatives) + b")", re.DOTALL)
                         if alternatives else None)
        self._lut = np.zeros(256, dtype=np.int64)
        for kind, size in self.sizes.items():
            if 0 < kind < 256:
                self._lut[kind] = size

    def learned(self, kind: int, size: int) -> None:
        self.sizes[kind] = size
        self._compile()

    def split(self, data: Any, valid: int, learn: Callable[[int], int | None] | None = None
              ) -> tuple[U8, I64, int]:
        """(kinds, byte offsets, bytes left undecoded) for ``data[:valid]``.
        ``learn(offset)`` gives the size of the record at ``offset`` from CUPTI."""
        words = np.frombuffer(data, dtype=np.int32, count=valid // 4)
        kinds_parts: list[U8] = []
        offset_parts: list[I64] = []
        position = 0
        while position < valid:
            kinds: U8 = np.zeros(0, dtype=np.uint8)
            if self._pattern is not None:
                kinds = np.frombuffer(b"".join(self._pattern.findall(data, position, valid)),
                                      dtype=np.uint8)
            sizes = self._lut[kinds]
            ends = position + np.cumsum(sizes)
            offsets = ends - sizes
            # In step: each record starts where the one before ended, and fits.
            in_step = (ends <= valid) & (
                words[np.minimum(offsets >> 2, max(len(words) - 1, 0))] == kinds)
            good = len(kinds) if bool(in_step.all()) else int(np.argmin(in_step))
            kinds_parts.append(kinds[:good])
            offset_parts.append(offsets[:good])
            position = int(ends[good - 1]) if good else position
            if position >= valid:
                break
            # A record findall skipped: a kind of unknown size starts at ``position``.
            kind = int(words[position >> 2]) if position + 8 <= valid else 0
            plausible = 0 < kind < MAX_KIND and kind not in self.sizes
            size = learn(position) if learn is not None and plausible else None
            if size is None or size < 8 or size % 8 or position + size > valid:
                return (np.concatenate(kinds_parts), np.concatenate(offset_parts),
                        valid - position)
            self.learned(kind, size)
        if not kinds_parts:
            return np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=np.int64), 0
        return np.concatenate(kinds_parts), np.concatenate(offset_parts), 0


@dataclass
class Batch:
    """The fields of one or more buffers' records, one array per field and kind.
    Kernels and memsets share the kernel columns: a memset's name is 0."""

    kernel_start: U64 = field(default_factory=lambda: np.zeros(0, np.uint64))  # ns
    kernel_end: U64 = field(default_factory=lambda: np.zeros(0, np.uint64))
    kernel_device: U32 = field(default_factory=lambda: np.zeros(0, np.uint32))
    kernel_stream: U32 = field(default_factory=lambda: np.zeros(0, np.uint32))
    kernel_correlation: U32 = field(default_factory=lambda: np.zeros(0, np.uint32))
    kernel_name: U64 = field(default_factory=lambda: np.zeros(0, np.uint64))  # char*; 0: memset
    copy_start: U64 = field(default_factory=lambda: np.zeros(0, np.uint64))
    copy_end: U64 = field(default_factory=lambda: np.zeros(0, np.uint64))
    copy_device: U32 = field(default_factory=lambda: np.zeros(0, np.uint32))
    copy_stream: U32 = field(default_factory=lambda: np.zeros(0, np.uint32))
    copy_kind: U8 = field(default_factory=lambda: np.zeros(0, np.uint8))  # MemcpyKind
    copy_bytes: U64 = field(default_factory=lambda: np.zeros(0, np.uint64))
    copy_correlation: U32 = field(default_factory=lambda: np.zeros(0, np.uint32))
    overhead_seconds: float = 0.0
    external_correlation: U32 = field(default_factory=lambda: np.zeros(0, np.uint32))
    external_id: U64 = field(default_factory=lambda: np.zeros(0, np.uint64))
    api_start: U64 = field(default_factory=lambda: np.zeros(0, np.uint64))  # launch, ns
    api_correlation: U32 = field(default_factory=lambda: np.zeros(0, np.uint32))
    records: int = 0
    undecoded_bytes: int = 0

    @classmethod
    def concat(cls, batches: Sequence[Batch]) -> Batch:
        if len(batches) == 1:
            return batches[0]
        result = cls()
        if not batches:
            return result
        for name in ("kernel_start", "kernel_end", "kernel_device", "kernel_stream",
                     "kernel_correlation", "kernel_name", "copy_start", "copy_end",
                     "copy_device", "copy_stream", "copy_kind", "copy_bytes", "copy_correlation",
                     "external_correlation", "external_id", "api_start", "api_correlation"):
            setattr(result, name, np.concatenate([getattr(b, name) for b in batches]))
        result.overhead_seconds = sum(b.overhead_seconds for b in batches)
        result.records = sum(b.records for b in batches)
        result.undecoded_bytes = sum(b.undecoded_bytes for b in batches)
        return result


def decode(data: Any, valid: int, splitter: RecordSplitter,
           learn: Callable[[int], int | None] | None = None) -> Batch:
    """The records of ``data[:valid]`` (a raw CUPTI activity buffer), as columns."""
    kinds, offsets, undecoded = splitter.split(data, valid, learn)
    u8: U8 = np.frombuffer(data, dtype=np.uint8, count=valid)
    u32: U32 = np.frombuffer(data, dtype=np.uint32, count=valid // 4)
    u64: U64 = np.frombuffer(data, dtype=np.uint64, count=valid // 8)
    batch = Batch(records=len(kinds), undecoded_bytes=undecoded)

    kernels = offsets[kinds == KIND_CONCURRENT_KERNEL]
    memsets = offsets[kinds == KIND_MEMSET]
    if len(kernels) or len(memsets):
        # Memsets share start and end (16, 24) and keep device, stream and correlation
        # at 32, 40, 44; each kind is read at its own offsets, then put in buffer order.
        order = np.argsort(np.concatenate([kernels, memsets]), kind="stable")

        def both(of_kernels: Any, of_memsets: Any) -> Any:
            return np.concatenate([of_kernels, of_memsets])[order]

        batch.kernel_start = both(u64[(kernels + KERNEL_START) >> 3],
                                  u64[(memsets + KERNEL_START) >> 3])
        batch.kernel_end = both(u64[(kernels + KERNEL_END) >> 3],
                                u64[(memsets + KERNEL_END) >> 3])
        batch.kernel_device = both(u32[(kernels + KERNEL_DEVICE) >> 2],
                                   u32[(memsets + COPY_DEVICE) >> 2])
        batch.kernel_stream = both(u32[(kernels + KERNEL_STREAM) >> 2],
                                   u32[(memsets + COPY_STREAM) >> 2])
        batch.kernel_correlation = both(u32[(kernels + KERNEL_CORRELATION) >> 2],
                                        u32[(memsets + COPY_CORRELATION) >> 2])
        batch.kernel_name = both(u64[(kernels + KERNEL_NAME) >> 3],
                                 np.zeros(len(memsets), dtype=np.uint64))
    copies = offsets[kinds == KIND_MEMCPY]
    if len(copies):
        batch.copy_kind = u8[copies + COPY_KIND]
        batch.copy_bytes = u64[(copies + COPY_BYTES) >> 3]
        batch.copy_start = u64[(copies + COPY_START) >> 3]
        batch.copy_end = u64[(copies + COPY_END) >> 3]
        batch.copy_device = u32[(copies + COPY_DEVICE) >> 2]
        batch.copy_stream = u32[(copies + COPY_STREAM) >> 2]
        batch.copy_correlation = u32[(copies + COPY_CORRELATION) >> 2]
    overheads = offsets[kinds == KIND_OVERHEAD]
    if len(overheads):
        start = u64[(overheads + OVERHEAD_START) >> 3]
        end = u64[(overheads + OVERHEAD_END) >> 3]
        done = end > start
        batch.overhead_seconds = int((end[done] - start[done]).sum()) / 1e9
    external = offsets[kinds == KIND_EXTERNAL_CORRELATION]
    if len(external):
        ours = external[u32[(external + EXTERNAL_KIND) >> 2] == EXTERNAL_KIND_CUSTOM2]
        batch.external_correlation = u32[(ours + EXTERNAL_CORRELATION) >> 2]
        batch.external_id = u64[(ours + EXTERNAL_ID) >> 3]
    calls = offsets[(kinds == KIND_RUNTIME) | (kinds == KIND_DRIVER)]
    if len(calls):
        batch.api_start = u64[(calls + API_START) >> 3]
        batch.api_correlation = u32[(calls + API_CORRELATION) >> 2]
    return batch


# --- kernel names -----------------------------------------------------------------


@functools.cache
def _cxa_demangle() -> tuple[Any, Any] | None:
    """libstdc++'s demangler and libc's free, or None where there is none."""
    try:
        libstdcxx = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        libc = ctypes.CDLL(None)
        function = libstdcxx.__cxa_demangle
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_void_p
    function.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.POINTER(ctypes.c_int)]
    free = libc.free
    free.argtypes = [ctypes.c_void_p]
    free.restype = None
    return function, free


@functools.lru_cache(maxsize=4096)
def demangle(symbol: str) -> str:
    """The C++ name of ``symbol`` (``_Z...``), or ``symbol`` itself."""
    if not symbol.startswith("_Z"):
        return symbol
    found = _cxa_demangle()
    if found is None:
        return symbol
    function, free = found
    status = ctypes.c_int(-1)
    pointer = function(symbol.encode(), None, None, ctypes.byref(status))
    if not pointer:
        return symbol
    try:
        text = ctypes.string_at(pointer) if status.value == 0 else b""
    finally:
        free(pointer)
    return text.decode(errors="replace") or symbol


_PLACEHOLDERS = (("(anonymous namespace)", "\x01"), ("operator()", "\x02"),
                 ("operator<<", "\x03"), ("operator<", "\x04"), ("operator>>", "\x05"),
                 ("operator>", "\x06"))
# Wrapper kernels whose first template argument is the real kernel (CUTLASS, CUB).
_WRAPPERS = frozenset({"Kernel", "Kernel2", "device_kernel", "kernel"})
_SIMPLE_ARGUMENT = re.compile(r"[A-Za-z_][\w:]*")


def _strip(text: str) -> tuple[str, str] | None:
    """``text`` without its <...> and (...) groups, and the first template
    argument at depth one; None when the brackets do not balance."""
    kept: list[str] = []
    first: list[str] = []
    depth = 0
    in_first = True
    for char in text:
        if char in "<(":
            depth += 1
            if depth > 1 and in_first and char == "<":
                in_first = False
            continue
        if char in ">)":
            depth -= 1
            if depth < 0:
                return None
            if depth == 0:
                in_first = False
            continue
        if depth == 0:
            kept.append(char)
        elif depth == 1 and in_first:
            if char == ",":
                in_first = False
            else:
                first.append(char)
    return ("".join(kept), "".join(first).strip()) if depth == 0 else None


def normalize_kernel_name(name: str) -> str:
    """A short, stable name for a (demangled) kernel: no return type, template
    arguments or parameters, e.g. ``at::native::vectorized_elementwise_kernel``."""
    text = name.strip()
    for literal, placeholder in _PLACEHOLDERS:
        text = text.replace(literal, placeholder)
    stripped = _strip(text)
    if stripped is None:
        result = text
    else:
        bare, first_argument = stripped
        # What is left of "void ns::kernel": the last word is the name.
        words = bare.split()
        result = words[-1] if words else bare
        last = result.rsplit("::", 1)[-1]
        if last in _WRAPPERS and _SIMPLE_ARGUMENT.fullmatch(first_argument):
            result = f"{result}<{first_argument}>"
    for literal, placeholder in _PLACEHOLDERS:
        result = result.replace(placeholder, literal)
    return result[:MAX_NAME_CHARS] or "unnamed"


class _ReadableMemory:
    """This process's readable mappings (from /proc/self/maps), so that a name
    pointer is read only where reading cannot fault, and at most to its mapping's end."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def _load(self) -> None:
        starts, ends = [], []
        with open("/proc/self/maps") as maps:
            for line in maps:
                span, permissions = line.split(maxsplit=2)[:2]
                if permissions.startswith("r"):
                    start, end = span.split("-")
                    starts.append(int(start, 16))
                    ends.append(int(end, 16))
        self._starts, self._ends = starts, ends

    def room(self, pointer: int) -> int:
        """Bytes readable from ``pointer`` on (0: none), looking again once if unknown."""
        for attempt in range(2):
            index = bisect.bisect_right(self._starts, pointer) - 1
            if index >= 0 and pointer < self._ends[index]:
                return self._ends[index] - pointer
            if attempt == 0:
                self._load()
        return 0


_memory = _ReadableMemory()


def _read_c_string(pointer: int) -> bytes:
    room = _memory.room(pointer) if pointer else 0
    if not room:
        raise ValueError("not readable")
    # Mangled names of deeply templated kernels run to many kilobytes.
    return ctypes.string_at(pointer, min(room, 1 << 16)).split(b"\0", 1)[0]


class KernelNames:
    """Kernel name pointers to ids: ``full`` names (demangled) and their short
    ``names``. CUPTI shares one string per kernel, so each pointer is read once."""

    def __init__(self, reader: Callable[[int], bytes] = _read_c_string) -> None:
        self._reader = reader
        self.full: list[str] = [MEMSET_NAME]  # full id 0: memsets
        self.names: list[str] = [MEMSET_NAME]
        self._name_ids: dict[str, int] = {MEMSET_NAME: 0}
        self._full_ids: dict[str, int] = {MEMSET_NAME: 0}
        self.full_to_name: list[int] = [0]
        self._by_pointer: dict[int, int] = {0: 0}

    def forget_pointers(self) -> None:
        """CUPTI was restarted: its strings may have moved."""
        self._by_pointer = {0: 0}

    def _full_id(self, pointer: int) -> int:
        try:
            raw = self._reader(pointer).decode(errors="replace")
        except Exception:
            raw = f"unreadable@{pointer:#x}"
        full = demangle(raw)
        known = self._full_ids.get(full)
        if known is not None:
            return known
        if len(self.full) >= MAX_FULL_NAMES:
            full = OTHER
            known = self._full_ids.get(full)
            if known is not None:
                return known
        short = normalize_kernel_name(full) if full != OTHER else OTHER
        name_id = self._name_ids.setdefault(short, len(self.names))
        if name_id == len(self.names):
            self.names.append(short)
        self._full_ids[full] = len(self.full)
        self.full.append(full)
        self.full_to_name.append(name_id)
        return len(self.full) - 1

    def full_ids(self, pointers: U64) -> I64:
        if not len(pointers):
            return np.zeros(0, dtype=np.int64)
        unique, inverse = np.unique(pointers, return_inverse=True)
        ids = np.empty(len(unique), dtype=np.int64)
        for index, pointer in enumerate(unique.tolist()):
            found = self._by_pointer.get(pointer)
            if found is None:
                found = self._by_pointer[pointer] = self._full_id(pointer)
            ids[index] = found
        return ids[inverse.reshape(-1)]


# --- aggregation ------------------------------------------------------------------


class KernelTable:
    """Launches and seconds per (kernel, device), at most ``cap`` of them; the
    rest is summed per device under ``other``.

    Counters stay monotonic: a kernel's time goes either to its own series or to
    ``other``, never moves between them. Rank follows recent time (halving every
    ``half_life_seconds``), so the warm-up's autotuning kernels give way to the
    steady state's: a newcomer well ahead of the weakest kernel kept replaces it.
    The replaced kernel's series ends; the newcomer's starts at 0."""

    def __init__(self, cap: int = DEFAULT_MAX_KERNELS, *, half_life_seconds: float = 60.0
                 ) -> None:
        self.cap = cap
        self.half_life_seconds = half_life_seconds
        self.rows: dict[tuple[str, int], list[float]] = {}  # -> [launches, seconds, score]
        self.other: dict[int, list[float]] = {}  # device -> [launches, seconds]
        self._candidates: dict[tuple[str, int], float] = {}  # not kept: recent seconds
        self._max_candidates = 4 * cap

    def add(self, entries: Iterable[tuple[str, int, int, float]], elapsed_seconds: float
            ) -> None:
        decay = 0.5 ** (max(0.0, elapsed_seconds) / self.half_life_seconds)
        if decay < 1.0:
            for kept in self.rows.values():
                kept[2] *= decay
            for key in self._candidates:
                self._candidates[key] *= decay
        for name, device, launches, seconds in entries:
            key = (name, device)
            row = self.rows.get(key)
            if row is None and len(self.rows) < self.cap and name != OTHER:
                row = self.rows[key] = [0, 0.0, 0.0]
            if row is not None:
                row[0] += launches
                row[1] += seconds
                row[2] += seconds
                continue
            other = self.other.setdefault(device, [0, 0.0])
            other[0] += launches
            other[1] += seconds
            if key in self._candidates or len(self._candidates) < self._max_candidates:
                self._candidates[key] = self._candidates.get(key, 0.0) + seconds
        self._rebalance()

    def _rebalance(self) -> None:
        for _ in range(8):  # a few swaps per batch is plenty and bounds the work
            if not self._candidates or len(self.rows) < self.cap:
                return
            best = max(self._candidates, key=self._candidates.__getitem__)
            worst = min(self.rows, key=lambda key: self.rows[key][2])
            if self._candidates[best] <= 2 * self.rows[worst][2]:
                return
            self._candidates[worst] = self.rows.pop(worst)[2]
            self.rows[best] = [0, 0.0, self._candidates.pop(best)]

    def snapshot(self) -> list[list[Any]]:
        rows: list[list[Any]] = [[name, device, int(row[0]), row[1]]
                                 for (name, device), row in self.rows.items()]
        rows += [[OTHER, device, int(row[0]), row[1]] for device, row in self.other.items()]
        return rows


class Attribution:
    """Which layer launched each kernel: CUPTI's external correlation records
    map a launch's correlation id to the id the layer hooks pushed. The record
    of a launch may come in a later buffer than its kernel's, so kernels not
    matched yet wait one more batch."""

    def __init__(self) -> None:
        self._correlation: U32 = np.zeros(0, dtype=np.uint32)  # sorted
        self._external: U64 = np.zeros(0, dtype=np.uint64)
        self.pending_correlation: U32 = np.zeros(0, dtype=np.uint32)
        self.pending_seconds: F64 = np.zeros(0, dtype=np.float64)

    def learn(self, correlation: U32, external: U64) -> None:
        if not len(correlation):
            return
        merged_correlation = np.concatenate([self._correlation, correlation])
        merged_external = np.concatenate([self._external, external])
        order = np.argsort(merged_correlation, kind="stable")[-MAX_CORRELATIONS:]
        self._correlation = merged_correlation[order]
        self._external = merged_external[order]

    def lookup(self, correlation: U32) -> tuple[npt.NDArray[np.bool_], U64]:
        """(found, external id) for each correlation id."""
        if not len(self._correlation) or not len(correlation):
            return np.zeros(len(correlation), dtype=bool), np.zeros(len(correlation), np.uint64)
        index = np.minimum(np.searchsorted(self._correlation, correlation),
                           len(self._correlation) - 1)
        found = self._correlation[index] == correlation
        return found, np.where(found, self._external[index], np.uint64(0))


@dataclass
class LayerIds:
    """How the layer hooks encode (layer, phase) into an external id:
    ``weight << 32 | base | index << 1 | phase``, phase 0 forward and 1 backward.
    ``base`` (bits 24-31) is new for each tracer start, so ids pushed for an
    earlier one are ignored; ``weight`` is the number of steps the timed step
    that pushed it stands for (0 read as 1), as the recorder weighs its CPU time."""

    base: int
    labels: Sequence[str]  # the hooks' list, growing as layers are hooked
    max_layers: int

    def decode(self, ids: U64) -> tuple[I64, I64]:
        """(label index or -1, phase) per id."""
        ours = ((ids >> np.uint64(24)) & np.uint64(0xFF)) == np.uint64((self.base >> 24) & 0xFF)
        local = (ids & np.uint64((1 << 24) - 1)).astype(np.int64)
        index = np.where(ours, local >> 1, -1)
        index = np.where(index < len(self.labels), index, -1)
        return index, local & 1

    @staticmethod
    def weights(ids: U64) -> F64:
        """How many steps each id's kernel time stands for."""
        weights: F64 = np.maximum(ids >> np.uint64(WEIGHT_SHIFT), np.uint64(1)).astype(
            np.float64)
        return weights


class KernelAggregator:
    """Totals since the tracer started, for the probe's snapshot reply."""

    def __init__(self, *, max_kernels: int = DEFAULT_MAX_KERNELS,
                 names: KernelNames | None = None) -> None:
        self.names = names if names is not None else KernelNames()
        self.table = KernelTable(max_kernels)
        self.attribution = Attribution()
        self.layer_ids: LayerIds | None = None
        self._bounds_ns = np.array([round(bound * 1e9) for bound in DURATION_BUCKETS],
                                   dtype=np.uint64)
        self._copy_labels = np.array([MEMCPY_LABELS.index(kind) for kind in MEMCPY_KINDS],
                                     dtype=np.int64)
        self.durations: dict[int, list[Any]] = {}  # device -> [counts, sum seconds]
        self.memcpy: dict[tuple[int, str], list[float]] = {}  # (device, kind) -> [bytes, s]
        self.layers: dict[tuple[str, str], float] = {}  # (label, phase) -> seconds
        self.overhead_seconds = 0.0
        self.records = 0
        self.incomplete_records = 0
        self.undecoded_bytes = 0

    def add(self, batch: Batch, elapsed_seconds: float) -> I64:
        """Fold ``batch`` in; returns each kernel's full-name id (for traces)."""
        self.records += batch.records
        self.undecoded_bytes += batch.undecoded_bytes
        self.overhead_seconds += batch.overhead_seconds
        self.attribution.learn(batch.external_correlation, batch.external_id)
        full_ids = self.names.full_ids(batch.kernel_name)
        self._add_kernels(batch, full_ids, elapsed_seconds)
        self._add_copies(batch)
        return full_ids

    def _add_kernels(self, batch: Batch, full_ids: I64, elapsed_seconds: float) -> None:
        start, end = batch.kernel_start, batch.kernel_end
        # A forced flush hands over kernels still running, with end 0: never counted.
        complete = end > start
        self.incomplete_records += int(len(start) - np.count_nonzero(complete))
        if not np.all(complete):
            start, end, full_ids = start[complete], end[complete], full_ids[complete]
            device = batch.kernel_device[complete]
            correlation = batch.kernel_correlation[complete]
        else:
            device, correlation = batch.kernel_device, batch.kernel_correlation
        device = np.minimum(device, MAX_DEVICES - 1).astype(np.int64)
        duration_ns = (end - start).astype(np.int64)
        seconds = duration_ns / 1e9
        name_ids = np.asarray(self.names.full_to_name, dtype=np.int64)[full_ids]
        keys, slots = np.unique(name_ids * MAX_DEVICES + device, return_inverse=True)
        launches = np.bincount(slots.reshape(-1)).tolist()
        totals = np.bincount(slots.reshape(-1), weights=seconds).tolist()
        names = self.names.names
        self.table.add(((names[key // MAX_DEVICES], key % MAX_DEVICES, launches[index],
                         totals[index]) for index, key in enumerate(keys.tolist())),
                       elapsed_seconds)
        if len(duration_ns):
            buckets = len(DURATION_BUCKETS) + 1
            slot = np.searchsorted(self._bounds_ns, duration_ns.astype(np.uint64), side="left")
            counts = np.bincount(device * buckets + slot).tolist()
            sums = np.bincount(device, weights=seconds).tolist()
            for gpu in np.unique(device).tolist():
                entry = self.durations.setdefault(gpu, [[0] * buckets, 0.0])
                for index, count in enumerate(counts[gpu * buckets:(gpu + 1) * buckets]):
                    entry[0][index] += count
                entry[1] += sums[gpu]
        self._attribute(correlation, seconds)

    def _attribute(self, correlation: U32, seconds: F64) -> None:
        if self.layer_ids is None:
            return
        pending_correlation = self.attribution.pending_correlation
        pending_seconds = self.attribution.pending_seconds
        # Kernels not matched last time get this one more chance, then are let go.
        found, external = self.attribution.lookup(pending_correlation)
        self._credit(external[found], pending_seconds[found])
        found, external = self.attribution.lookup(correlation)
        self._credit(external[found], seconds[found])
        self.attribution.pending_correlation = correlation[~found]
        self.attribution.pending_seconds = seconds[~found]

    def _credit(self, external: U64, seconds: F64) -> None:
        if self.layer_ids is None or not len(external):
            return
        index, phase = self.layer_ids.decode(external)
        mine = index >= 0
        if not np.any(mine):
            return
        key = index[mine] * 2 + phase[mine]
        # A timed step's kernel time counts once for each step it stands for.
        totals = np.bincount(key, weights=seconds[mine] * self.layer_ids.weights(external[mine]))
        labels = self.layer_ids.labels
        for slot in np.flatnonzero(totals).tolist():
            label_index = slot // 2
            label = labels[label_index] if label_index < self.layer_ids.max_layers else OTHER
            pair = (label, "backward" if slot % 2 else "forward")
            self.layers[pair] = self.layers.get(pair, 0.0) + float(totals[slot])

    def _add_copies(self, batch: Batch) -> None:
        if not len(batch.copy_start):
            return
        complete = batch.copy_end > batch.copy_start
        self.incomplete_records += int(len(complete) - np.count_nonzero(complete))
        kind = np.minimum(batch.copy_kind[complete], len(MEMCPY_KINDS) - 1).astype(np.int64)
        label = self._copy_labels[kind]
        device = np.minimum(batch.copy_device[complete], MAX_DEVICES - 1).astype(np.int64)
        key = device * len(MEMCPY_LABELS) + label
        seconds = (batch.copy_end[complete] - batch.copy_start[complete]).astype(np.int64) / 1e9
        copied = np.bincount(key, weights=batch.copy_bytes[complete].astype(np.float64))
        taken = np.bincount(key, weights=seconds)
        for slot in np.flatnonzero(np.bincount(key)).tolist():
            entry = self.memcpy.setdefault(
                (slot // len(MEMCPY_LABELS), MEMCPY_LABELS[slot % len(MEMCPY_LABELS)]),
                [0, 0.0])
            entry[0] += int(copied[slot])
            entry[1] += float(taken[slot])

    def snapshot(self) -> dict[str, Any]:
        return {
            "kernels": self.table.snapshot(),
            "duration_buckets": list(DURATION_BUCKETS),
            "durations": [[device, list(counts), total]
                          for device, (counts, total) in sorted(self.durations.items())],
            "memcpy": [[device, kind, int(copied), seconds]
                       for (device, kind), (copied, seconds) in sorted(self.memcpy.items())],
            "layers": [[label, phase, seconds]
                       for (label, phase), seconds in self.layers.items()],
            "overhead_seconds": self.overhead_seconds,
            "records": self.records,
            "incomplete_records": self.incomplete_records,
            "undecoded_bytes": self.undecoded_bytes,
        }
