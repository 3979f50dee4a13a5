"""The agent's own writer of the text format says exactly what prometheus_client
says, for every family the agent exports."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

from dlprof_agent.exporters import text
from dlprof_agent.exporters.prometheus import NodeCollector
from dlprof_agent.exporters.text import render_text
from dlprof_agent.model.snapshot import NodeSnapshot
from dlprof_agent.probe_link.samples import LayerSample
from tests.full_snapshot import full_snapshot


def test_every_family_of_a_full_snapshot_is_written_as_prometheus_client_writes_it() -> None:
    snapshot = full_snapshot()
    assert snapshot.probe is not None
    # Label values that need escaping: a quote, a backslash and a newline.
    odd = LayerSample('block"1\\conv\nrelu', 0.5, 3, 0.25, 3)
    snapshot = dataclasses.replace(snapshot, probe=dataclasses.replace(
        snapshot.probe, layers=(*snapshot.probe.layers, odd)))
    registry = CollectorRegistry()
    registry.register(NodeCollector(lambda: NodeSnapshot.of_one(snapshot), interval_seconds=1.0))
    expected = generate_latest(registry)
    assert render_text(registry) == expected
    assert b'layer="block\\"1\\\\conv\\nrelu"' in expected


def test_a_node_with_two_targets_is_written_the_same() -> None:
    first, second = full_snapshot(100), full_snapshot(200)
    node = NodeSnapshot(timestamp_seconds=1.0, monotonic_seconds=1.0, host=first.host,
                        gpu=first.gpu, targets=(first, second), agent=first.agent)
    registry = CollectorRegistry()
    registry.register(NodeCollector(lambda: node, interval_seconds=1.0))
    assert render_text(registry) == generate_latest(registry)


def test_families_it_does_not_write_itself_fall_back_to_prometheus_client() -> None:
    class Mixed:
        def collect(self) -> list[GaugeMetricFamily | InfoMetricFamily]:
            gauge = GaugeMetricFamily("dlprof_test", "A gauge.")
            gauge.add_metric([], 1.0)
            info = InfoMetricFamily("dlprof_test_build", "An info.", value={"version": "1"})
            return [gauge, info]

    registry = CollectorRegistry()
    registry.register(Mixed())
    assert render_text(registry) == generate_latest(registry)


def test_lines_kept_by_series_are_bounded_and_the_output_stays_the_same() -> None:
    """More series than the writer keeps by value: the first MAX_KEPT_SERIES are
    kept, the rest are formatted anew, and every scrape reads as prometheus_client's."""
    count = text.MAX_KEPT_SERIES + 500
    values = [0.0] * count

    class Wide:
        def collect(self) -> list[GaugeMetricFamily]:
            gauge = GaugeMetricFamily("dlprof_test_wide", "Many series.", labels=["i"])
            for i, value in enumerate(values):
                gauge.add_metric([str(i)], value)
            return [gauge]

    registry = CollectorRegistry()
    registry.register(Wide())
    for scrape in range(3):
        values[-1] = values[0] = float(scrape)  # one kept series changes, one not kept
        assert render_text(registry) == generate_latest(registry)
        assert len(text._WRITTEN.by_series) == text.MAX_KEPT_SERIES
