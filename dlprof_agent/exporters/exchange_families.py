"""How each target's probe reads keep their deadline: whether its in-process
figures are this pass's, and how many reads have missed so far."""

from __future__ import annotations

from prometheus_client.core import Metric

from dlprof_agent.exporters.families import counter, gauge
from dlprof_agent.model.snapshot import Snapshot


def exchange_families(snapshot: Snapshot) -> list[Metric]:
    pid = str(snapshot.target_pid)
    stale = gauge("dlprof_probe_stale",
                  "1 while the probe's figures are its last good sample, kept because "
                  "this pass's read missed its deadline, else 0.", ["pid"])
    stale.add_metric([pid], 1 if snapshot.probe_stale else 0)
    misses = counter("dlprof_probe_deadline_misses_total",
                     "Probe reads that missed their deadline (no whole reply in time).",
                     ["pid"])
    misses.add_metric([pid], snapshot.probe_misses)
    return [stale, misses]
