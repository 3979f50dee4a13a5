"""Renders the latest snapshot as Prometheus metric families.

Families are built fresh on every scrape, so the series of a process that has
exited simply disappear. A scrape never triggers sampling. Names and labels
here are the contract documented in docs/metrics.md.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import (
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from dlprof_agent.collectors.gpu_samples import GpuSample
from dlprof_agent.collectors.identity import Identity
from dlprof_agent.exporters.exchange_families import exchange_families
from dlprof_agent.exporters.families import (
    agent_families,
    finding_families,
    gpu_families,
    host_families,
    process_families,
    target_families,
)
from dlprof_agent.exporters.probe_families import gpu_labels, probe_families
from dlprof_agent.model.snapshot import NodeSnapshot, Snapshot
from dlprof_agent.probe_link.samples import ProbeSample


def merged(per_target: Iterable[list[Metric]]) -> list[Metric]:
    """One family per name, holding every target's samples: an exposition may
    name a family only once. The targets' families are left as they are (they
    may be kept for the next scrape: ProbeFamilies)."""
    families: dict[str, Metric] = {}
    copies: set[str] = set()  # the families here that are copies of our own
    for target in per_target:
        for family in target:
            known = families.get(family.name)
            if known is None:
                families[family.name] = family
                continue
            if family.name not in copies:
                known = families[family.name] = copy.copy(known)
                known.samples = list(known.samples)
                copies.add(family.name)
            known.samples.extend(family.samples)
    return list(families.values())


class ProbeFamilies:
    """``probe_families`` of each target, kept from one scrape to the next while
    its probe sample is the same object: a probe whose replies are read every few
    passes (probe_link/reply_pacing.py) keeps its sample, and its thousands of
    series are then neither built nor (exporters/text.py) written again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[int, tuple[bool, ProbeSample | None, object, Identity | None,
                                    list[Metric]]] = {}

    def of(self, targets: Iterable[Snapshot], gpu: GpuSample | None) -> list[list[Metric]]:
        devices = tuple(sorted(gpu_labels(gpu).items()))
        with self._lock:
            kept, self._kept = self._kept, {}
            result = []
            for target in targets:
                last = kept.get(target.target_pid)
                if (last is not None and last[0] == target.probe_up
                        and last[1] is target.probe and target.probe is not None
                        and last[2] == devices and last[3] == target.identity):
                    families = last[4]
                else:
                    families = probe_families(target.target_pid, target.probe_up,
                                              target.probe, gpu, target.identity)
                self._kept[target.target_pid] = (target.probe_up, target.probe, devices,
                                                 target.identity, families)
                result.append(families)
            return result


class NodeCollector(Collector):
    """The agent's latest pass: the node once, and every target, each under its
    own pid. A target that has gone is simply not in the pass. Renders whatever
    ``latest`` returns at scrape time; reads nothing itself."""

    def __init__(self, latest: Callable[[], NodeSnapshot | None], *,
                 interval_seconds: float) -> None:
        self._latest = latest
        self._interval_seconds = interval_seconds
        self._probe_families = ProbeFamilies()

    def describe(self) -> Iterable[Metric]:
        # Empty: registration must not call collect(), which needs a sample.
        return []

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
        yield from merged(self._probe_families.of(node.targets, node.gpu))
        yield from merged(exchange_families(target) for target in node.targets)
        yield from merged(finding_families(target.target_pid, target.findings,
                                           target.identity)
                          for target in node.targets)


def registry_of(collector: Collector) -> CollectorRegistry:
    """A registry holding ``collector`` alone: what exporters.http serves."""
    registry = CollectorRegistry()
    registry.register(collector)
    return registry
