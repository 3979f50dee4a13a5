"""Renders the latest snapshot as Prometheus metric families.

Families are built fresh on every scrape, so the series of a process that has
exited simply disappear. A scrape never triggers sampling. Names and labels
here are the contract documented in docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from prometheus_client.core import (
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from dlprof_agent.exporters.exchange_families import exchange_families
from dlprof_agent.exporters.families import (
    agent_families,
    finding_families,
    gpu_families,
    host_families,
    process_families,
    target_families,
)
from dlprof_agent.exporters.probe_families import probe_families
from dlprof_agent.model.snapshot import NodeSnapshot, Snapshot

_Published = TypeVar("_Published", Snapshot, NodeSnapshot)


class _LatestCollector(Collector, Generic[_Published]):
    """Renders whatever ``latest`` returns at scrape time; reads nothing itself."""

    def __init__(self, latest: Callable[[], _Published | None], *,
                 interval_seconds: float) -> None:
        self._latest: Callable[[], _Published | None] = latest
        self._interval_seconds = interval_seconds

    def describe(self) -> Iterable[Metric]:
        # Empty: registration must not call collect(), which needs a sample.
        return []


class SnapshotCollector(_LatestCollector[Snapshot]):
    """One target: the agent's latest Snapshot."""

    def collect(self) -> Iterator[Metric]:
        snapshot = self._latest()
        yield from agent_families(snapshot, self._interval_seconds)
        if snapshot is None:
            return
        yield from target_families(snapshot)
        yield from process_families(snapshot.processes)
        if snapshot.host is not None:
            yield from host_families(snapshot.host)
        yield from gpu_families(snapshot.gpu)
        yield from probe_families(snapshot.target_pid, snapshot.probe_up, snapshot.probe,
                                  snapshot.gpu)
        yield from exchange_families(snapshot)
        yield from finding_families(snapshot.target_pid, snapshot.findings)


def merged(per_target: Iterable[list[Metric]]) -> list[Metric]:
    """One family per name, holding every target's samples: an exposition may
    name a family only once."""
    families: dict[str, Metric] = {}
    for target in per_target:
        for family in target:
            known = families.get(family.name)
            if known is None:
                families[family.name] = family
            else:
                known.samples.extend(family.samples)
    return list(families.values())


class NodeCollector(_LatestCollector[NodeSnapshot]):
    """The daemon's latest pass: the node once, and every target, each under its
    own pid. A target that has gone is simply not in the pass."""

    def collect(self) -> Iterator[Metric]:
        node = self._latest()
        yield from agent_families(node, self._interval_seconds)
        if node is None:
            return
        yield from merged(target_families(target) for target in node.targets)
        yield from merged(process_families(target.processes) for target in node.targets)
        if node.host is not None:
            yield from host_families(node.host)
        yield from gpu_families(node.gpu)
        yield from merged(probe_families(target.target_pid, target.probe_up, target.probe,
                                         node.gpu)
                          for target in node.targets)
        yield from merged(exchange_families(target) for target in node.targets)
        yield from merged(finding_families(target.target_pid, target.findings)
                          for target in node.targets)


def registry_of(collector: Collector) -> CollectorRegistry:
    """A registry holding ``collector`` alone: what exporters.http serves."""
    registry = CollectorRegistry()
    registry.register(collector)
    return registry
