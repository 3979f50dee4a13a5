"""Series budgets: how many series one target, and the whole agent, may export.

A tenant decides how many layers and kernels its probe reports; the agent
decides how many series it serves. Past a budget the layer, kernel and layer-GPU
rows beyond the top ones by time fold into one ``other`` row per family (per
device for kernels), as the probe itself does past ``max_layers``. Nothing goes
silently: every series left out is counted by reason, and the folded sample
says how many of its series were folded (``ProbeSample.series_folded``), which
the ``series_capped`` finding reports for that target.

Folding happens once per sampling pass, before the snapshot is kept, so what the
agent holds per target, and what a scrape renders, stay within the budget
however many tenants report however many rows. The node's own series (host,
GPUs, the agent itself: a few hundred, whatever the tenants do) are outside the
budgets.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from dlprof_agent.collectors.process import ProcessSample
from dlprof_agent.probe.messages import OTHER
from dlprof_agent.probe_link.reply_rows import share
from dlprof_agent.probe_link.samples import (
    KernelRow,
    LayerGpuRow,
    LayerSample,
    ProbeSample,
)

DEFAULT_TARGET_SERIES = 5_000  # well above what a ResNet-50 with --layers and kernels exports
DEFAULT_AGENT_SERIES = 50_000
# Series of a target beside its processes and its probe: its findings and their
# evidence (14 rules, a few figures each) and dlprof_target_up.
FINDINGS_SERIES = 100
# Per process: info, CPU by mode, memory (3), threads, switches (2), I/O (4), fds,
# start; and per thread-name group: CPU by mode and a thread count.
PROCESS_SERIES = 16
THREAD_GROUP_SERIES = 4
REASONS = ("target_budget", "agent_budget")
__all__ = ["share"]  # defined with the reply's rows, which share the budget the same way
_Row = TypeVar("_Row")
_Key = TypeVar("_Key")


def histogram_series(bucket_counts: Sequence[int]) -> int:
    return len(bucket_counts) + 2  # a _bucket per bucket (+Inf included), _sum, _count


def _layer_series(layer: LayerSample) -> int:
    return 2 * ((layer.forward_calls > 0) + (layer.backward_calls > 0))


def _open_ended(probe: ProbeSample) -> tuple[int, int, int]:
    """Series of the layer, kernel and layer-GPU rows."""
    kernels = probe.kernels
    traced = kernels is not None and kernels.traced
    return (sum(_layer_series(layer) for layer in probe.layers),
            2 * len(kernels.kernels) if kernels is not None and traced else 0,
            len(kernels.layers) if kernels is not None and traced else 0)


def probe_series(probe: ProbeSample) -> int:
    """The series ``exporters/probe_families.py`` renders for ``probe``."""
    fixed = (1 + len(probe.steps) + len(probe.samples)
             + histogram_series(probe.step_bucket_counts) + len(probe.phase_seconds)
             + (probe.layer_sampled_steps is not None) + len(probe.settings) + 2
             + len(probe.dropped_messages) + (probe.phase_split is not None)
             + len(probe.cpu_seconds))
    kernels = probe.kernels
    if kernels is not None:
        fixed += 3 + (kernels.since > 0)
        if kernels.traced:
            fixed += (sum(histogram_series(d.bucket_counts) for d in kernels.durations)
                      + 2 * len(kernels.memcpy) + 2 + 3 * bool(kernels.record_clock)
                      + (kernels.collective_seconds() is not None))
    return fixed + sum(_open_ended(probe))


def process_series(processes: Iterable[ProcessSample]) -> int:
    """The series of a target's process tree and findings, beside its probe's."""
    return FINDINGS_SERIES + sum(PROCESS_SERIES + THREAD_GROUP_SERIES * len(p.thread_groups)
                                 for p in processes)


def _keep_top(rows: Sequence[_Row], allowed: int, *, cost: Callable[[_Row], int],
              seconds: Callable[[_Row], float], name: Callable[[_Row], str],
              other_cost: int) -> tuple[list[_Row], list[_Row]]:
    """The rows kept, the longest first, within ``allowed`` series with room left
    for the ``other`` rows the rest fold into; and the rest. Both in their order."""
    if sum(cost(row) for row in rows) <= allowed:
        return list(rows), []
    kept: set[int] = set()
    used = other_cost
    # A row already named "other" (the probe's own, past max_layers) folds in too.
    for row in sorted((row for row in rows if name(row) != OTHER), key=seconds,
                      reverse=True):
        if used + cost(row) > allowed:
            break
        kept.add(id(row))
        used += cost(row)
    return ([row for row in rows if id(row) in kept],
            [row for row in rows if id(row) not in kept])


def _grouped(rows: Iterable[_Row], key: Callable[[_Row], _Key]) -> dict[_Key, list[_Row]]:
    """One pass: a reply may hold 64 devices of 201 kernels."""
    groups: dict[_Key, list[_Row]] = {}
    for row in rows:
        groups.setdefault(key(row), []).append(row)
    return groups


def _fold_layers(layers: tuple[LayerSample, ...], allowed: int) -> tuple[LayerSample, ...]:
    kept, rest = _keep_top(layers, allowed, cost=_layer_series,
                           seconds=lambda r: r.forward_seconds + r.backward_seconds,
                           name=lambda r: r.name, other_cost=4)
    if not rest:
        return layers
    other = LayerSample(OTHER, sum(r.forward_seconds for r in rest),
                        sum(r.forward_calls for r in rest),
                        sum(r.backward_seconds for r in rest),
                        sum(r.backward_calls for r in rest))
    return (*kept, other) if _layer_series(other) <= max(0, allowed - sum(
        _layer_series(r) for r in kept)) else tuple(kept)


def _fold_kernels(rows: tuple[KernelRow, ...], allowed: int) -> tuple[KernelRow, ...]:
    devices = sorted({row.device for row in rows})
    kept, rest = _keep_top(rows, allowed, cost=lambda r: 2, seconds=lambda r: r.seconds,
                           name=lambda r: r.kernel, other_cost=2 * len(devices))
    if not rest:
        return rows
    others = []
    room = allowed - 2 * len(kept)
    by_device = _grouped(rest, lambda r: r.device)
    for device in devices:
        folded = by_device.get(device, [])
        if folded and room >= 2:
            others.append(KernelRow(OTHER, device, sum(r.launches for r in folded),
                                    sum(r.seconds for r in folded)))
            room -= 2
    return (*kept, *others)


def _fold_layer_gpu(rows: tuple[LayerGpuRow, ...], allowed: int) -> tuple[LayerGpuRow, ...]:
    phases = sorted({row.phase for row in rows})
    kept, rest = _keep_top(rows, allowed, cost=lambda r: 1, seconds=lambda r: r.seconds,
                           name=lambda r: r.layer, other_cost=len(phases))
    if not rest:
        return rows
    room = allowed - len(kept)
    others = []
    by_phase = _grouped(rest, lambda r: r.phase)
    for phase in phases:
        folded = by_phase.get(phase, [])
        if folded and room >= 1:
            others.append(LayerGpuRow(OTHER, phase, sum(r.seconds for r in folded)))
            room -= 1
    return (*kept, *others)


def fold(probe: ProbeSample, max_series: int) -> ProbeSample:
    """``probe`` with its layer, kernel and layer-GPU rows folded so that it
    renders at most ``max_series`` series (or only its fixed ones, if they alone
    are more); ``series_folded`` adds how many were left out."""
    wanted = probe_series(probe)
    if wanted <= max_series:
        return probe
    layer_wants, kernel_wants, layer_gpu_wants = _open_ended(probe)
    fixed = wanted - layer_wants - kernel_wants - layer_gpu_wants
    layers_allowed, kernels_allowed, layer_gpu_allowed = share(
        (layer_wants, kernel_wants, layer_gpu_wants), max(0, max_series - fixed))
    kernels = probe.kernels
    if kernels is not None and kernels.traced:
        kernels = replace(kernels, kernels=_fold_kernels(kernels.kernels, kernels_allowed),
                          layers=_fold_layer_gpu(kernels.layers, layer_gpu_allowed))
    folded = replace(probe, layers=_fold_layers(probe.layers, layers_allowed),
                     kernels=kernels)
    return replace(folded, series_folded=probe.series_folded + wanted
                   - probe_series(folded))


@dataclass
class SeriesBudget:
    """The budgets of one agent (``attach``: one target; ``daemon``: all of its
    targets), and the count of series they left out, by reason. Thread-safe: the
    sampling loop folds, a scrape reads the counts."""

    per_target: int = DEFAULT_TARGET_SERIES
    total: int | None = None  # None: one target, whose budget is the whole
    # The last pass's folds, by (pid, series allowed): a probe read less often
    # (reply_pacing) gives the same sample again, folded once.
    _folds: dict[tuple[int, int], tuple[ProbeSample, ProbeSample]] = field(
        default_factory=dict, init=False)
    _dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0),
                                     init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def fold(self, targets: Sequence[tuple[ProbeSample | None, int]]
             ) -> list[ProbeSample | None]:
        """Each target's probe sample (None: it has none), given the series its
        processes and findings take, folded to the budgets."""
        per_target: list[tuple[ProbeSample | None, int, int]] = []
        folds: dict[tuple[int, int], tuple[ProbeSample, ProbeSample]] = {}
        for sample, beside in targets:
            if sample is None:
                per_target.append((None, beside, 0))
                continue
            folded = self._fold(sample, max(0, self.per_target - beside), folds)
            # All of it: what the reply's rows lost to this budget before they were
            # built (samples, reply_rows) is counted here, once per pass.
            per_target.append((folded, beside, folded.series_folded))
        dropped = dict.fromkeys(REASONS, 0)
        dropped["target_budget"] = sum(count for _, _, count in per_target)
        result = [probe for probe, _, _ in per_target]
        if self.total is not None:
            wants = [(probe_series(probe) if probe is not None else 0) + beside
                     for probe, beside, _ in per_target]
            for index, (grant, want) in enumerate(zip(share(wants, self.total), wants,
                                                      strict=True)):
                probe = result[index]
                if probe is None or grant >= want:
                    continue
                folded = self._fold(probe, max(0, grant - per_target[index][1]), folds)
                dropped["agent_budget"] += folded.series_folded - probe.series_folded
                result[index] = folded
        with self._lock:
            for reason, count in dropped.items():
                self._dropped[reason] += count
            self._folds = folds
        return result

    def _fold(self, probe: ProbeSample, max_series: int,
              folds: dict[tuple[int, int], tuple[ProbeSample, ProbeSample]]) -> ProbeSample:
        key = (probe.pid, max_series)
        last = self._folds.get(key)
        folded = last[1] if last is not None and last[0] is probe else fold(probe, max_series)
        folds[key] = (probe, folded)
        return folded

    def dropped(self) -> tuple[tuple[str, int], ...]:
        """Series left out so far, summed over sampling passes, by reason."""
        with self._lock:
            return tuple(sorted(self._dropped.items()))
