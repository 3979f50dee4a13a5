"""Synthetic CUPTI activity buffers, laid out exactly as CUPTI writes them.

The record layouts are cupti-python's own numpy dtypes, written out here field
by field (name, offset, type) and item size: ``activity_kernel13_dtype`` &c. of
cupti-python 13.4.0 and ``c_upti_activity_kernel9_dtype`` &c. of 12.8.0. They
are kept apart from ``probe/kernel_records.py`` on purpose, so that the decoder
is checked against the layout and not against itself. Kernel names are real C
strings in this process's memory, so the decoder reads them through their
pointers as it reads CUPTI's.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_FieldList = list[tuple[str, str, int]]  # (name, numpy type, offset)

_KERNEL_FIELDS: _FieldList = [
    ("kind", "<i4", 0), ("registers_per_thread", "<u2", 6), ("start", "<u8", 16),
    ("end", "<u8", 24), ("completed", "<u8", 32), ("device_id", "<u4", 40),
    ("context_id", "<u4", 44), ("stream_id", "<u4", 48), ("grid_x", "<i4", 52),
    ("grid_y", "<i4", 56), ("grid_z", "<i4", 60), ("block_x", "<i4", 64),
    ("block_y", "<i4", 68), ("block_z", "<i4", 72), ("correlation_id", "<u4", 92),
    ("grid_id", "<i8", 96), ("name", "<u8", 104), ("queued", "<u8", 120),
    ("submitted", "<u8", 128), ("graph_node_id", "<u8", 144), ("graph_id", "<u4", 156),
    ("channel_id", "<u4", 168), ("cluster_x", "<u4", 176)]
_MEMCPY_FIELDS: _FieldList = [
    ("kind", "<i4", 0), ("copy_kind", "u1", 4), ("src_kind", "u1", 5), ("dst_kind", "u1", 6),
    ("bytes", "<u8", 8), ("start", "<u8", 16), ("end", "<u8", 24), ("device_id", "<u4", 32),
    ("context_id", "<u4", 36), ("stream_id", "<u4", 40), ("correlation_id", "<u4", 44),
    ("runtime_correlation_id", "<u4", 48), ("graph_node_id", "<u8", 64),
    ("graph_id", "<u4", 72), ("channel_id", "<u4", 76)]
_MEMSET_FIELDS: _FieldList = [
    ("kind", "<i4", 0), ("value", "<u4", 4), ("bytes", "<u8", 8), ("start", "<u8", 16),
    ("end", "<u8", 24), ("device_id", "<u4", 32), ("context_id", "<u4", 36),
    ("stream_id", "<u4", 40), ("correlation_id", "<u4", 44), ("flags_", "<u2", 48),
    ("memory_kind", "<u2", 50), ("graph_node_id", "<u8", 64)]
_OVERHEAD_FIELDS: _FieldList = [
    ("kind", "<i4", 0), ("overhead_kind", "<i4", 4), ("object_kind", "<i4", 8),
    ("process_id", "<u4", 12), ("thread_id", "<u4", 16), ("start", "<u8", 24),
    ("end", "<u8", 32), ("correlation_id", "<u4", 40), ("overhead_data", "<i8", 48)]
_EXTERNAL_FIELDS: _FieldList = [
    ("kind", "<i4", 0), ("external_kind", "<i4", 4), ("external_id", "<u8", 8),
    ("correlation_id", "<u4", 16)]
_API_FIELDS: _FieldList = [
    ("kind", "<i4", 0), ("cbid", "<u4", 4), ("start", "<u8", 8), ("end", "<u8", 16),
    ("process_id", "<u4", 24), ("thread_id", "<u4", 28), ("correlation_id", "<u4", 32)]


def _dtype(fields: _FieldList, itemsize: int) -> np.dtype[Any]:
    return np.dtype({"names": [f[0] for f in fields], "formats": [f[1] for f in fields],
                     "offsets": [f[2] for f in fields], "itemsize": itemsize})


# kind -> dtype, per cupti-python version.
LAYOUTS: dict[str, dict[int, np.dtype[Any]]] = {
    "12.8": {10: _dtype(_KERNEL_FIELDS, 208), 1: _dtype(_MEMCPY_FIELDS, 96),
             2: _dtype(_MEMSET_FIELDS, 88), 17: _dtype(_OVERHEAD_FIELDS, 56),
             39: _dtype(_EXTERNAL_FIELDS, 24), 5: _dtype(_API_FIELDS, 40),
             4: _dtype(_API_FIELDS, 40)},
    "13.4": {10: _dtype(_KERNEL_FIELDS, 248), 1: _dtype(_MEMCPY_FIELDS, 112),
             2: _dtype(_MEMSET_FIELDS, 104), 17: _dtype(_OVERHEAD_FIELDS, 56),
             39: _dtype(_EXTERNAL_FIELDS, 24), 5: _dtype(_API_FIELDS, 40),
             4: _dtype(_API_FIELDS, 40)},
}
KERNEL, MEMCPY, MEMSET, OVERHEAD, EXTERNAL, RUNTIME, DRIVER = 10, 1, 2, 17, 39, 5, 4
HTOD, DTOH, DTOD, PTOP, HTOH = 1, 2, 8, 10, 9
CUSTOM0, CUSTOM2 = 3, 5


@dataclass
class BufferBuilder:
    """Appends records one by one; ``bytes()`` gives the buffer CUPTI would hand over."""

    version: str = "13.4"
    parts: list[bytes] = field(default_factory=list)
    count: int = 0
    # The C strings the records point to; shared between builders, one per name,
    # as CUPTI shares one string per kernel.
    strings: dict[str, Any] = field(default_factory=dict)

    def name_pointer(self, name: str) -> int:
        if name not in self.strings:
            self.strings[name] = ctypes.create_string_buffer(name.encode())
        return ctypes.addressof(self.strings[name])

    def add(self, kind: int, **values: int) -> BufferBuilder:
        record = np.zeros(1, dtype=LAYOUTS[self.version][kind])
        record["kind"] = kind
        for key, value in values.items():
            record[key] = value
        # Fields CUPTI fills that the decoder must not confuse with record starts.
        if kind == KERNEL:
            for key in ("grid_y", "grid_z", "block_y", "block_z"):
                record[key] = values.get(key, 1)
        self.parts.append(record.tobytes())
        self.count += 1
        return self

    def kernel(self, name: str, start: int, end: int, *, device: int = 0, stream: int = 7,
               correlation: int = 0) -> BufferBuilder:
        return self.add(KERNEL, name=self.name_pointer(name), start=start, end=end,
                        device_id=device, stream_id=stream, correlation_id=correlation,
                        grid_x=10, block_x=256, context_id=1)

    def memcpy(self, copy_kind: int, nbytes: int, start: int, end: int, *, device: int = 0,
               stream: int = 7, correlation: int = 0) -> BufferBuilder:
        return self.add(MEMCPY, copy_kind=copy_kind, bytes=nbytes, start=start, end=end,
                        device_id=device, stream_id=stream, correlation_id=correlation,
                        src_kind=1, dst_kind=2)

    def memset(self, nbytes: int, start: int, end: int, *, device: int = 0, stream: int = 7,
               correlation: int = 0) -> BufferBuilder:
        return self.add(MEMSET, bytes=nbytes, start=start, end=end, device_id=device,
                        stream_id=stream, correlation_id=correlation, value=10)

    def overhead(self, start: int, end: int) -> BufferBuilder:
        return self.add(OVERHEAD, overhead_kind=65536, start=start, end=end, object_kind=2)

    def external(self, correlation: int, external_id: int, external_kind: int = CUSTOM2
                 ) -> BufferBuilder:
        return self.add(EXTERNAL, external_kind=external_kind, external_id=external_id,
                        correlation_id=correlation)

    def api(self, correlation: int, start: int = 1, end: int = 2, kind: int = RUNTIME
            ) -> BufferBuilder:
        return self.add(kind, cbid=211, start=start, end=end, correlation_id=correlation,
                        process_id=4242, thread_id=1)

    def bytes(self) -> bytes:
        return b"".join(self.parts)

    def sizes(self) -> dict[int, int]:
        return {kind: dtype.itemsize for kind, dtype in LAYOUTS[self.version].items()}
