"""Throughput of the probe's CUPTI record decoding and aggregation, on one core.

Builds synthetic activity buffers in CUPTI 13.4's record layouts (4 MiB each, as
the tracer's pool hands out), then times, separately:

- decode: finding every record (``RecordSplitter``) and gathering the fields
  into numpy columns (``kernel_records.decode``);
- aggregate: kernel names, per-(kernel, device) totals with the top-200 cap,
  duration histograms, memcpy totals and per-layer attribution
  (``KernelAggregator.add``).

Two mixes: continuous tracing (kernels, with some memcpys, memsets and CUPTI
overhead records) and layer attribution on (an external correlation and an API
record before every launch, so records of 24, 40 and 248 bytes alternate).
Target: at least 2 million records per second for each.

    python benchmarks/cupti_decode.py [--records 1000000]
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dlprof_agent.probe import kernel_records as kr
from dlprof_agent.probe import kernel_totals as ktot

BUFFER_BYTES = 4 << 20
SIZES = kr.RECORD_SIZES["13.4"]
KERNEL, MEMCPY, MEMSET, OVERHEAD = (kr.KIND_CONCURRENT_KERNEL, kr.KIND_MEMCPY, kr.KIND_MEMSET,
                                    kr.KIND_OVERHEAD)
EXTERNAL, RUNTIME = kr.KIND_EXTERNAL_CORRELATION, kr.KIND_RUNTIME
TARGET_PER_SECOND = 2_000_000


def _names(count: int) -> tuple[list[Any], np.ndarray[Any, np.dtype[np.uint64]]]:
    strings = [ctypes.create_string_buffer(
        f"_ZN2at6native18elementwise_kernelILi128ELi{index}EZNS0_22gpu_kernel_implEEEviT1_"
        .encode()) for index in range(count)]
    return strings, np.array([ctypes.addressof(s) for s in strings], dtype=np.uint64)


def _buffer(kinds: np.ndarray[Any, np.dtype[np.int64]], rng: np.random.Generator,
            pointers: np.ndarray[Any, np.dtype[np.uint64]], first_correlation: int) -> bytes:
    """The records of ``kinds``, packed as CUPTI packs them, with plausible fields."""
    lut = np.zeros(64, dtype=np.int64)
    for kind, size in SIZES.items():
        lut[kind] = size
    sizes = lut[kinds]
    offsets = np.cumsum(sizes) - sizes
    data = np.zeros(int(sizes.sum()), dtype=np.uint8)
    u32, u64 = data.view(np.uint32), data.view(np.uint64)
    u32[offsets >> 2] = kinds
    correlation = first_correlation + np.arange(len(kinds), dtype=np.uint64)
    start = 10**12 + correlation * 1_000
    duration = rng.integers(1_000, 200_000, len(kinds), dtype=np.uint64)
    for kind, fields in (
            (KERNEL, ((16, 64, start), (24, 64, start + duration), (40, 32, 0),
                      (48, 32, 7), (92, 32, correlation),
                      (104, 64, pointers[rng.integers(0, len(pointers), len(kinds))]))),
            (MEMCPY, ((4, 8, 1), (8, 64, duration * 16), (16, 64, start),
                      (24, 64, start + duration), (44, 32, correlation))),
            (MEMSET, ((8, 64, 4096), (16, 64, start), (24, 64, start + duration),
                      (44, 32, correlation))),
            (OVERHEAD, ((24, 64, start), (32, 64, start + 500))),
            (EXTERNAL, ((4, 32, kr.EXTERNAL_KIND_CUSTOM2), (16, 32, correlation + 2))),
            (RUNTIME, ((8, 64, start), (32, 32, correlation + 1)))):
        chosen = kinds == kind
        at = offsets[chosen]
        for field_offset, bits, values in fields:
            value = values[chosen] if isinstance(values, np.ndarray) else values
            if bits == 64:
                u64[(at + field_offset) >> 3] = value
            elif bits == 32:
                u32[(at + field_offset) >> 2] = value
            else:
                data[at + field_offset] = value
    if (kinds == EXTERNAL).any():  # the external ids: layer i of 50, forward
        at = offsets[kinds == EXTERNAL]
        u64[(at + 8) >> 3] = (1 << 24) | (rng.integers(0, 50, len(at)) << 1).astype(np.uint64)
    return data.tobytes()


def build(mix: str, records: int, seed: int = 0
          ) -> tuple[list[bytes], list[Any], int]:
    """(buffers, the name strings to keep alive, record count)."""
    rng = np.random.default_rng(seed)
    if mix == "continuous":
        kinds = rng.choice([KERNEL, MEMCPY, MEMSET, OVERHEAD], size=records,
                           p=[0.90, 0.04, 0.05, 0.01]).astype(np.int64)
    else:  # attribution: external correlation + runtime API record, then the kernel
        kinds = np.tile(np.array([EXTERNAL, RUNTIME, KERNEL], dtype=np.int64),
                        records // 3 + 1)[:records]
    strings, pointers = _names(300)
    buffers: list[bytes] = []
    per_buffer = BUFFER_BYTES // SIZES[KERNEL]
    for first in range(0, records, per_buffer):
        buffers.append(_buffer(kinds[first:first + per_buffer], rng, pointers, first))
    return buffers, strings, records


def best_of(runs: int, work: Callable[[], Any]) -> float:
    best = float("inf")
    for _ in range(runs):
        began = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - began)
    return best


def measure(mix: str, records: int) -> tuple[float, float]:
    buffers, _strings, count = build(mix, records)
    splitter = kr.RecordSplitter(SIZES)
    batches = [kr.decode(data, len(data), splitter) for data in buffers]
    assert sum(b.records for b in batches) == count, "the benchmark's buffers do not decode"

    decode_seconds = best_of(3, lambda: [kr.decode(data, len(data), splitter)
                                         for data in buffers])

    def aggregate() -> None:
        aggregator = ktot.KernelAggregator()
        aggregator.layer_ids = ktot.LayerIds(1 << 24, [f"layer{i}" for i in range(50)], 512)
        for batch in batches:
            aggregator.add(batch, 0.25)

    aggregate_seconds = best_of(3, aggregate)
    return count / decode_seconds, count / aggregate_seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    worst = float("inf")
    for mix in ("continuous", "attribution"):
        decode_rate, aggregate_rate = measure(mix, args.records)
        worst = min(worst, decode_rate, aggregate_rate)
        print(f"{mix:12} {args.records:>9} records: decode {decode_rate / 1e6:6.2f} M "
              f"records/s, aggregate {aggregate_rate / 1e6:6.2f} M records/s")
    verdict = "meets" if worst >= TARGET_PER_SECOND else "misses"
    print(f"slowest {worst / 1e6:.2f} M records/s: {verdict} the target of "
          f"{TARGET_PER_SECOND / 1e6:g} M records/s on one core")
    return 0 if worst >= TARGET_PER_SECOND else 1


if __name__ == "__main__":
    raise SystemExit(main())
