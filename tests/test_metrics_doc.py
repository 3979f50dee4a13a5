"""docs/metrics.md and the exporter must name the same families, types and labels."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dlprof_agent.exporters.prometheus import NodeCollector
from dlprof_agent.model.snapshot import NodeSnapshot
from tests.full_snapshot import full_snapshot

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
ROW = re.compile(r"^\| `(dlprof_[a-z0-9_]+)` \| (gauge|counter|histogram) \|([^|]*)\|")


def documented() -> dict[str, tuple[str, frozenset[str]]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match:
            name, kind, labels = match.groups()
            rows[name] = (kind, frozenset(re.findall(r"`([a-z_]+)`", labels)))
    return rows


def exported() -> dict[str, tuple[str, frozenset[str]]]:
    registry = CollectorRegistry()
    snapshot = full_snapshot()
    registry.register(NodeCollector(lambda: NodeSnapshot.of_one(snapshot), interval_seconds=1.0))
    families = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = frozenset(label for sample in family.samples for label in sample.labels
                           if label != "le")  # a histogram's bucket bound
        families[name] = (family.type, labels)
    return families


def test_every_exported_family_is_documented_with_its_type_and_labels() -> None:
    docs, code = documented(), exported()
    assert len(code) > 40
    assert sorted(set(code) - set(docs)) == [], "exported but not in docs/metrics.md"
    for name, (kind, labels) in code.items():
        assert docs[name] == (kind, labels), name


def test_every_documented_family_is_exported() -> None:
    assert sorted(set(documented()) - set(exported())) == []


def test_issue_contract_names_are_exported() -> None:
    contract = {
        "dlprof_process_cpu_seconds_total": {"pid", "mode"},
        "dlprof_process_resident_memory_bytes": {"pid"},
        "dlprof_process_resident_memory_peak_bytes": {"pid"},
        "dlprof_process_virtual_memory_bytes": {"pid"},
        "dlprof_process_threads": {"pid"},
        "dlprof_thread_group_cpu_seconds_total": {"pid", "thread_name", "mode"},
        "dlprof_thread_group_threads": {"pid", "thread_name"},
        "dlprof_process_context_switches_total": {"pid", "kind"},
        "dlprof_process_io_bytes_total": {"pid", "direction"},
        "dlprof_host_cpu_seconds_total": {"mode"},
        "dlprof_host_cpus": {"kind"},
        "dlprof_gpu_utilization_ratio": {"gpu", "uuid"},
        "dlprof_gpu_memory_used_bytes": {"gpu", "uuid"},
        "dlprof_gpu_memory_total_bytes": {"gpu", "uuid"},
        "dlprof_gpu_pcie_throughput_bytes_per_second": {"gpu", "uuid", "direction"},
        "dlprof_gpu_power_watts": {"gpu", "uuid"},
        "dlprof_process_gpu_memory_bytes": {"pid", "gpu"},
        "dlprof_process_gpu_sm_utilization_ratio": {"pid", "gpu"},
        "dlprof_target_up": {"pid"},
        "dlprof_gpu_available": set(),
        "dlprof_collector_errors_total": {"collector"},
    }
    code = exported()
    for name, labels in contract.items():
        assert code[name][1] == labels, name
