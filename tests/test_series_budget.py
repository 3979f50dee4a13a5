"""Series budgets: a tenant reporting thousands of long-named layers and kernels
is folded to the agent's budget, with an `other` row per family, the names cut,
the drops counted and a finding for the capped target."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from dlprof_agent.collectors.labels import MAX_LABEL_CHARS
from dlprof_agent.exporters.families import agent_families
from dlprof_agent.exporters.probe_families import probe_families
from dlprof_agent.model.findings import rules
from dlprof_agent.model.findings.catalogue import Finding
from dlprof_agent.model.findings.tracker import FindingsTracker
from dlprof_agent.model.findings.window import Window, point_of
from dlprof_agent.model.snapshot import NodeSnapshot, Snapshot
from dlprof_agent.probe.messages import OTHER
from dlprof_agent.probe_link.samples import ProbeSample
from dlprof_agent.probe_link.series_budget import (
    SeriesBudget,
    fold,
    probe_series,
    process_series,
    share,
)
from tests.full_snapshot import full_snapshot

LAYERS = 4096
NAME_CHARS = 510


def wide_reply(layers: int = LAYERS, kernels: int = 0, devices: int = 1) -> dict[str, object]:
    """A snapshot reply as a tenant may send one: within the reply's bounds, with
    as many long-named layers (and kernels) as those allow."""
    return {"ok": True, "probe": {
        "step_source": "optimizer", "steps": {"steady": 10}, "samples": {},
        "step_buckets": [0.1], "step_bucket_counts": [5, 5], "step_seconds_sum": 1.0,
        "last_step_seconds": 0.1, "phase_seconds": {"forward": 0.5},
        "layers": [[f"{i:05d}".ljust(NAME_CHARS, "x"), 0.001 * (i + 1), 1, 0.002, 1]
                   for i in range(layers)],
        "hook_errors": 0}, "settings": {"torch": {"version": "2.5"}}, "dropped": {},
        "kernels": {"state": "active", "reason": "", "kernels": [
            [f"kernel_{i}".ljust(300, "k"), i % devices, 3, 0.0001 * (i + 1)]
            for i in range(kernels)], "layers": [], "memcpy": [], "durations": []}}


def rendered_series(families: Iterable[Metric]) -> list[str]:
    class Fixed(Collector):
        def collect(self) -> Iterable[Metric]:
            return families

    registry = CollectorRegistry()
    registry.register(Fixed())
    return [line for line in generate_latest(registry).decode().splitlines()
            if line and not line.startswith("#")]


def test_the_series_count_is_what_the_exporter_renders() -> None:
    probe = full_snapshot().probe
    assert probe is not None
    for sample in (probe, ProbeSample.from_reply(7, wide_reply(layers=50, kernels=30,
                                                               devices=2))):
        assert probe_series(sample) == len(rendered_series(probe_families(
            sample.pid, True, sample)))


def test_long_names_are_cut_to_the_label_bound_and_stay_distinct() -> None:
    sample = ProbeSample.from_reply(7, wide_reply(layers=100, kernels=10))
    names = [layer.name for layer in sample.layers]
    assert max(len(name) for name in names) == MAX_LABEL_CHARS
    assert len(set(names)) == 100
    assert names[0].startswith("00000xxx")
    assert sample.kernels is not None
    assert all(len(row.kernel) <= MAX_LABEL_CHARS for row in sample.kernels.kernels)


def test_a_tenant_of_4096_long_layers_is_folded_to_the_target_budget() -> None:
    sample = ProbeSample.from_reply(7, wide_reply())
    assert probe_series(sample) > 16_000  # what it exported before any budget
    folded = fold(sample, 5_000)
    series = rendered_series(probe_families(7, True, folded))
    assert len(series) <= 5_000
    assert folded.series_folded == probe_series(sample) - probe_series(folded) > 11_000
    other = [layer for layer in folded.layers if layer.name == OTHER]
    assert len(other) == 1
    # The longest layers are kept; the rest add up, time and calls, in "other".
    kept = [layer for layer in folded.layers if layer.name != OTHER]
    assert min(layer.forward_seconds for layer in kept) > max(
        layer.forward_seconds for layer in sample.layers if layer not in kept)
    assert sum(layer.forward_calls for layer in folded.layers) == LAYERS
    assert abs(sum(layer.forward_seconds for layer in folded.layers)
               - sum(layer.forward_seconds for layer in sample.layers)) < 1e-6


def test_kernel_rows_fold_into_an_other_row_per_device() -> None:
    sample = ProbeSample.from_reply(7, wide_reply(layers=0, kernels=12_864, devices=64))
    folded = fold(sample, 5_000)
    assert len(rendered_series(probe_families(7, True, folded))) <= 5_000
    assert folded.kernels is not None and sample.kernels is not None
    others = [row for row in folded.kernels.kernels if row.kernel == OTHER]
    assert sorted(row.device for row in others) == list(range(64))
    assert sum(row.launches for row in folded.kernels.kernels) == 3 * 12_864


def test_a_sample_within_the_budget_is_left_as_it_is() -> None:
    probe = full_snapshot().probe
    assert probe is not None
    assert fold(probe, 5_000) is probe


def test_share_is_max_min_fair() -> None:
    assert share([10, 20], 100) == [10, 20]
    assert share([100, 100, 100], 150) == [50, 50, 50]
    assert share([10, 1_000, 1_000], 510) == [10, 250, 250]
    assert share([5, 5], 0) == [0, 0]


def test_the_agent_budget_shares_itself_among_tenants_and_counts_both_reasons() -> None:
    budget = SeriesBudget(per_target=5_000, total=9_000)
    wide = ProbeSample.from_reply(7, wide_reply())
    small = full_snapshot().probe
    beside = process_series(full_snapshot().processes)
    folded = budget.fold([(wide, beside), (wide, beside), (wide, beside), (small, beside),
                          (None, beside)])
    assert folded[3] is small and folded[4] is None
    total = sum(probe_series(p) + beside for p in folded if p is not None)
    assert total <= 9_000
    dropped = dict(budget.dropped())
    assert dropped["target_budget"] > 3 * 11_000
    assert dropped["agent_budget"] > 0
    assert sum(p.series_folded for p in folded[:3] if p is not None) == sum(dropped.values())
    # Counts add up pass after pass, and are exported.
    budget.fold([(wide, beside)])
    assert dict(budget.dropped())["target_budget"] > dropped["target_budget"]
    node = NodeSnapshot(timestamp_seconds=0.0, monotonic_seconds=0.0, host=None, gpu=None,
                        targets=(), series_dropped=budget.dropped())
    lines = rendered_series(agent_families(node, 1.0))
    assert any(line.startswith('dlprof_agent_series_dropped_total{reason="agent_budget"}')
               for line in lines)


def test_a_capped_target_raises_the_series_capped_finding() -> None:
    base = full_snapshot()
    probe = fold(ProbeSample.from_reply(base.target_pid, wide_reply()), 5_000)
    tracker = FindingsTracker()
    findings: tuple[Finding, ...] = ()
    for second in range(12):
        snapshot: Snapshot = dataclasses.replace(base, monotonic_seconds=float(second),
                                                 probe=probe)
        findings = tracker.update(point_of(snapshot))
    capped = {f.id: f for f in findings}["series_capped"]
    assert capped.active
    assert dict(capped.evidence)["series_folded"] == probe.series_folded
    uncapped = dataclasses.replace(base, probe=base.probe)
    assert rules.series_capped(_window_of(uncapped)) is not None
    check = rules.series_capped(_window_of(uncapped))
    assert check is not None and not check.holds


def _window_of(snapshot: Snapshot) -> Window:
    first = point_of(dataclasses.replace(snapshot, monotonic_seconds=0.0))
    last = point_of(dataclasses.replace(snapshot, monotonic_seconds=2.0))
    return Window((first, last))
