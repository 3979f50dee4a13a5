"""Decoded CUPTI records folded into bounded totals, with ``np.bincount``:
per-(kernel, device) launches and seconds, a duration histogram per device,
memcpy bytes and seconds per direction, CUPTI's overhead, and kernel time per
layer (through the external correlation records the layer hooks cause).

Runs in the training process on the probe's thread, once kernel tracing starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dlprof_agent.probe.kernel_names import KernelNames
from dlprof_agent.probe.kernel_records import F64, I64, MEMCPY_KINDS, U32, U64, Batch
from dlprof_agent.probe.messages import MAX_DEVICES, OTHER, KernelTimes, KernelTotals

# Upper bounds in seconds: kernels run from about a microsecond to many milliseconds.
DURATION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3,
                    2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
MEMCPY_LABELS = ("h2d", "d2h", "d2d", "p2p", "h2h", "other")
DEFAULT_MAX_KERNELS = 200
MAX_CORRELATIONS = 1 << 20  # external correlation entries kept for a late kernel record
WEIGHT_SHIFT = 32  # external ids: the weight of a timed step sits above this bit


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

    def snapshot(self) -> list[KernelTimes]:
        rows: list[KernelTimes] = [[name, device, int(row[0]), row[1]]
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


@dataclass(slots=True)
class _Durations:
    """One device's kernel duration histogram."""

    counts: list[int]  # per bucket, not cumulative; one more than DURATION_BUCKETS
    seconds: float = 0.0


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
        self.durations: dict[int, _Durations] = {}
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
                entry = self.durations.setdefault(gpu, _Durations([0] * buckets))
                for index, count in enumerate(counts[gpu * buckets:(gpu + 1) * buckets]):
                    entry.counts[index] += count
                entry.seconds += sums[gpu]
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

    def snapshot(self) -> KernelTotals:
        return {
            "kernels": self.table.snapshot(),
            "duration_buckets": list(DURATION_BUCKETS),
            "durations": [[device, list(entry.counts), entry.seconds]
                          for device, entry in sorted(self.durations.items())],
            "memcpy": [[device, kind, int(copied), seconds]
                       for (device, kind), (copied, seconds) in sorted(self.memcpy.items())],
            "layers": [[label, phase, seconds]
                       for (label, phase), seconds in self.layers.items()],
            "overhead_seconds": self.overhead_seconds,
            "records": self.records,
            "incomplete_records": self.incomplete_records,
            "undecoded_bytes": self.undecoded_bytes,
        }
