"""The classic Prometheus text format (0.0.4), written straight from the metric
families the agent builds.

prometheus_client's own writer checks and escapes every label name of every
sample; at a thousand series that is most of a scrape's cost. The agent's label
names are fixed identifiers of its own, so only label values (which carry
process, thread and layer names) are escaped here. The output is byte for byte
what prometheus_client writes for the same families; a family of a type the
agent does not build falls back to it.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import utils
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

_WRITTEN_TYPES = frozenset({"gauge", "counter", "histogram"})
# Values as Go writes floats (+Inf, 1e+06), the way Prometheus's own exporters do.
_format_value: Callable[[float], str] = utils.floatToGoString


def _escape_value(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def render_text(registry: Collector) -> bytes:
    families = list(registry.collect())
    if any(family.type not in _WRITTEN_TYPES for family in families):
        return generate_latest(registry)
    lines: list[str] = []
    for family in families:
        name = family.name + "_total" if family.type == "counter" else family.name
        documentation = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
        lines.append(f"# HELP {name} {documentation}\n# TYPE {name} {family.type}\n")
        for sample in family.samples:
            if sample.name.endswith("_created") or sample.timestamp is not None:
                return generate_latest(registry)  # not what the agent writes
            labels = sample.labels
            if labels:
                pairs = ",".join(f'{key}="{_escape_value(labels[key])}"'
                                 for key in sorted(labels))
                lines.append(f"{sample.name}{{{pairs}}} {_format_value(sample.value)}\n")
            else:
                lines.append(f"{sample.name} {_format_value(sample.value)}\n")
    return "".join(lines).encode()
