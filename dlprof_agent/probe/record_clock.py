"""Which clock CUPTI's records count in, and their timestamps put back in ns.

Another CUPTI client can replace the clock that stamps every record. Kineto
(torch.profiler) registers its TSC clock with
``cuptiActivityRegisterTimestampCallback`` each time its GPU tracing starts and
leaves it registered after the profiler stops. Records then count TSC ticks, 2.10
per ns on the H100 of the GPU evidence, and every duration read as ns comes out
2.10x too long (evidence 2026-11-23 item 4, and 2026-11-26: 76.2 against 36.3 ms
of kernels per step). Registering NULL does not undo it: CUPTI 13.0 answers
CUPTI_ERROR_INVALID_PARAMETER and the records stayed in ticks (2026-11-26).

So the records' clock is measured, never assumed:

- at open, ``cuptiGetTimestamp``'s own rate against ``perf_counter``: one that runs
  at another rate follows the registered clock, and the records do too;
- otherwise each drain compares the newest record's end with
  ``cuptiGetTimestamp``: CUPTI documents the two as one clock, so records far from
  it count in another one. Its rate is then the slope of the newest ends against
  ``perf_counter`` over at least ``CALIBRATION_SECONDS``, taken on the upper
  envelope (the newest kernel ended at most a drain before it was read, and on a
  busy GPU just before). Batches wait for it, a bounded number of them.

Once known, the clock is fixed for the binding: the tracer makes a new
``RecordClock`` at each open, since another client may have registered a clock
while we stood aside. Converted timestamps are ``perf_counter`` ns plus
``offset_ns``, which is what the trace window reads them with.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from dlprof_agent.probe.kernel_records import Batch

NATIVE, FOREIGN, UNKNOWN = "native", "foreign", "unknown"
RATE_TOLERANCE = 0.02  # a clock within 2% of 1 ns per ns is CUPTI's own
RATE_PROBE_SECONDS = 0.02
# A record ends before it is read; CUPTI hands finished buffers over within a
# flush period, so one on CUPTI's clock ends well within this of "now".
PLAUSIBLE_LAG_NS = 60 * 10**9
PLAUSIBLE_LEAD_NS = 10**9
CALIBRATION_SECONDS = 1.0
MAX_HELD_BATCHES = 64  # about 30 s of drains with nothing decided: bounded either way
ENVELOPE_POINTS = 32  # a drain late by a descheduled thread is outvoted by its neighbours


def newest_end(batch: Batch) -> int | None:
    """The latest end among the batch's complete kernels and copies, raw."""
    ends = [column[column > 0] for column in (batch.kernel_end, batch.copy_end)]
    found = [int(column.max()) for column in ends if len(column)]
    return max(found) if found else None


class RecordClock:
    """Puts the timestamps of one binding's records on ns (see the module doc)."""

    def __init__(self, cupti_now_ns: Callable[[], int],
                 perf_ns: Callable[[], int] = time.perf_counter_ns,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._cupti_now_ns = cupti_now_ns
        self._perf_ns = perf_ns
        self.state = UNKNOWN
        self.measured_by = ""  # "rate" (at open) or "records" (their ends); "" until known
        self.ticks_per_ns = 1.0
        self.offset_ns = 0  # CUPTI's ns clock minus perf_counter's, as converted
        self.dropped_batches = 0  # held too long, or on a clock never measured
        self._anchor = (0, 0)  # (raw, perf ns) that converts to perf ns
        self._first: list[tuple[int, int]] = []  # (newest raw end, perf ns at the drain)
        self._recent: list[tuple[int, int]] = []
        self._held: list[tuple[Batch, float]] = []
        self._implausible = False
        raw0, perf0 = self._tight_read()
        sleep(RATE_PROBE_SECONDS)
        raw1, perf1 = self._tight_read()
        rate = (raw1 - raw0) / (perf1 - perf0) if perf1 > perf0 else 1.0
        if abs(rate - 1.0) > RATE_TOLERANCE:
            self._decide(FOREIGN, rate, (raw1, perf1), "rate")
        else:
            self.offset_ns = raw1 - perf1

    @property
    def converts(self) -> bool:
        """Whether records are rewritten onto perf_counter ns (``offset_ns`` 0)."""
        return self.state == FOREIGN

    def _tight_read(self) -> tuple[int, int]:
        """(cuptiGetTimestamp, perf ns between the reads), the tightest of three."""
        best: tuple[int, int, int] | None = None
        for _ in range(3):
            before = self._perf_ns()
            raw = self._cupti_now_ns()
            after = self._perf_ns()
            if best is None or after - before < best[0]:
                best = (after - before, raw, (before + after) // 2)
        assert best is not None
        return best[1], best[2]

    def _decide(self, state: str, ticks_per_ns: float, anchor: tuple[int, int],
                measured_by: str) -> None:
        self.state, self.ticks_per_ns, self._anchor = state, ticks_per_ns, anchor
        self.measured_by = measured_by
        if state == FOREIGN:
            self.offset_ns = 0  # converted timestamps are perf_counter ns

    def take(self, batch: Batch, elapsed: float) -> list[tuple[Batch, float]]:
        """The batches ready to be counted, converted, in order: this one and any
        held before, or none while the clock is not yet known."""
        if self.state == NATIVE:
            return [(batch, elapsed)]
        if self.state == FOREIGN:
            return [(self._convert(batch), elapsed)]
        self._held.append((batch, elapsed))
        newest = newest_end(batch)
        if newest is not None:
            perf = self._perf_ns()
            now = perf + self.offset_ns
            if not self._implausible and now - PLAUSIBLE_LAG_NS <= newest <= now \
                    + PLAUSIBLE_LEAD_NS:
                self._decide(NATIVE, 1.0, (0, 0), "records")
            else:
                self._implausible = True
                self._observe(newest, perf)
        if self.state == UNKNOWN:
            if len(self._held) > MAX_HELD_BATCHES:
                self._held.pop(0)
                self.dropped_batches += 1
            return []
        return self._release()

    def settle(self) -> list[tuple[Batch, float]]:
        """Tracing stops: what is held, if its clock can be told; else it is
        dropped (counted) rather than counted in unknown units."""
        if self.state == UNKNOWN and self._implausible:
            self._estimate(minimum_ns=0.2 * CALIBRATION_SECONDS * 1e9)
        if self.state == UNKNOWN and self._implausible:
            self.dropped_batches += len(self._held)
            self._held.clear()
            return []
        return self._release()

    def _release(self) -> list[tuple[Batch, float]]:
        held, self._held = self._held, []
        if self.state == FOREIGN:
            return [(self._convert(batch), elapsed) for batch, elapsed in held]
        return held

    def _observe(self, newest: int, perf: int) -> None:
        point = (newest, perf)
        if len(self._first) < ENVELOPE_POINTS:
            self._first.append(point)
        self._recent = [*self._recent[-(ENVELOPE_POINTS - 1):], point]
        self._estimate(minimum_ns=CALIBRATION_SECONDS * 1e9)

    def _estimate(self, minimum_ns: float) -> None:
        if not self._first or not self._recent:
            return
        first, last = self._first[0], self._recent[-1]
        if last[1] - first[1] < max(minimum_ns, 1):
            return
        rate = (last[0] - first[0]) / (last[1] - first[1])
        # The upper envelope: of each end's points, the one read soonest after its
        # kernel ended sits highest above the line.
        early = max(self._first, key=lambda p: p[0] - rate * p[1])
        late = max(self._recent, key=lambda p: p[0] - rate * p[1])
        if late[1] - early[1] >= minimum_ns and late[0] > early[0]:
            rate = (late[0] - early[0]) / (late[1] - early[1])
        if rate <= 0:
            return
        self._decide(FOREIGN, rate, late, "records")

    def _convert(self, batch: Batch) -> Batch:
        raw0, perf0 = self._anchor
        scale = self.ticks_per_ns

        def on_ns(column: np.ndarray) -> np.ndarray:
            if not len(column):
                return column
            # In int64 first: raw TSC ticks can pass float64's exact range.
            ticks = (column.astype(np.int64) - np.int64(raw0)).astype(np.float64)
            converted = ticks / scale + perf0
            # 0 marks a timestamp CUPTI could not take: it stays 0.
            return np.where(column > 0, np.maximum(converted, 1), 0).astype(np.uint64)

        for name in ("kernel_start", "kernel_end", "copy_start", "copy_end", "api_start"):
            setattr(batch, name, on_ns(getattr(batch, name)))
        batch.overhead_seconds /= scale
        return batch
