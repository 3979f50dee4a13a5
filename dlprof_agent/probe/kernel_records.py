"""CUPTI activity buffers, decoded in bulk into columns of numpy arrays.

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
   views of the buffer as uint8/uint32/uint64, into a ``Batch``.

``kernel_totals`` folds batches into totals, ``kernel_names`` names the kernels.

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

import re
import struct
from collections.abc import Callable, Mapping, Sequence
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

MAX_KIND = 128  # CUpti_ActivityKind values are below this (60 kinds in CUPTI 13)

# A buffer is Any: an object with the buffer protocol (a ctypes array, bytes).
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
