"""The classic Prometheus text format (0.0.4), written straight from the metric
families the agent builds.

prometheus_client's own writer checks and escapes every label name of every
sample; at a thousand series that is most of a scrape's cost. The agent's label
names are fixed identifiers of its own, so only label values (which carry
process, thread and layer names) are escaped here. The output is byte for byte
what prometheus_client writes for the same families, but for control characters
in label values; a family of a type the agent does not build falls back to it.

Label values may hold any UTF-8, but the format escapes only ``\\``, ``"`` and
newline; any other backslash sequence is a parse error in Prometheus, and a raw
NUL, carriage return or DEL, written as prometheus_client does, reaches every
tool downstream (a terminal, a log line, a C string) as is. So the other C0
controls and DEL become U+FFFD, the replacement character: the value still
parses, and a reader sees that something was there.
"""

from __future__ import annotations

from collections.abc import Callable
from math import copysign

from prometheus_client import utils
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

_WRITTEN_TYPES = frozenset({"gauge", "counter", "histogram"})
# Values as Go writes floats (+Inf, 1e+06), the way Prometheus's own exporters do.
_format_value: Callable[[float], str] = utils.floatToGoString


_REPLACEMENT = "\ufffd"
_ESCAPES = {**{code: _REPLACEMENT for code in [*range(0x20), 0x7F]},
            ord("\\"): r"\\", ord("\n"): r"\n", ord('"'): r"\""}


def _escape_value(value: str) -> str:
    # isprintable() is False for every control character: one C call decides most values.
    if value.isprintable() and "\\" not in value and '"' not in value:
        return value
    return value.translate(_ESCAPES)


# What the last exposition wrote, kept for the next: the lines by sample (a sample
# kept from one scrape to the next, exporters.prometheus.ProbeFamilies, is written
# once; keyed by id, holding the sample so that its id stays its own), the lines by
# series (a series whose value has not changed since, most of a pass's, is not
# formatted again) and the families' headers. Replaced whole each time, so
# that what has gone is not kept.
#
# Lines by series are kept for the first MAX_KEPT_SERIES series only. A probe
# reply decoded anew brings thousands of new samples at once (three wide tenants:
# 12,000); keyed by series too, their keys lay among the lines kept by sample,
# and the daemon's RSS stayed 3-5 MiB higher after the next scrape freed them. A
# held sample's lines are reused by sample anyway; a node's own series
# (processes, threads, GPUs) fit.
MAX_KEPT_SERIES = 4096


class _Written:
    def __init__(self) -> None:
        self.by_sample: dict[int, tuple[Sample, bytes]] = {}
        self.by_series: dict[tuple[str, tuple[str, ...], tuple[str, ...]],
                             tuple[float, bytes]] = {}
        self.headers: dict[tuple[str, str, str], bytes] = {}


_WRITTEN = _Written()


# Lines are kept as bytes and joined as bytes: a scrape of thousands of series
# then makes one copy of the exposition, not a str and its encoded bytes at once.
def _line(sample: Sample) -> bytes:
    labels = sample.labels
    if labels:
        pairs = ",".join(f'{key}="{_escape_value(labels[key])}"' for key in sorted(labels))
        return f"{sample.name}{{{pairs}}} {_format_value(sample.value)}\n".encode()
    return f"{sample.name} {_format_value(sample.value)}\n".encode()


def _header(family: Metric) -> bytes:
    name = family.name + "_total" if family.type == "counter" else family.name
    documentation = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {documentation}\n# TYPE {name} {family.type}\n".encode()


def render_text(registry: Collector) -> bytes:
    families = list(registry.collect())
    if any(family.type not in _WRITTEN_TYPES for family in families):
        return generate_latest(registry)
    lines: list[bytes] = []
    before, written = _WRITTEN.by_sample, {}
    series_before = _WRITTEN.by_series
    series_written: dict[tuple[str, tuple[str, ...], tuple[str, ...]], tuple[float, bytes]] = {}
    headers_before, headers = _WRITTEN.headers, {}
    for family in families:
        header_key = (family.name, family.type, family.documentation)
        header = headers_before.get(header_key) or _header(family)
        headers[header_key] = header
        lines.append(header)
        for sample in family.samples:
            known = before.get(id(sample))
            if known is not None and known[0] is sample:
                line = known[1]
            elif sample.name.endswith("_created") or sample.timestamp is not None:
                return generate_latest(registry)  # not what the agent writes
            else:
                labels = sample.labels
                value = sample.value
                series = (sample.name, tuple(labels), tuple(labels.values()))
                kept = series_before.get(series)
                # 0.0 and -0.0 are equal but written apart; NaN equals nothing.
                line = (kept[1] if kept is not None and kept[0] == value and (
                    value != 0 or copysign(1, value) == copysign(1, kept[0]))
                    else _line(sample))
                if len(series_written) < MAX_KEPT_SERIES:
                    series_written[series] = (value, line)
            written[id(sample)] = (sample, line)
            lines.append(line)
    _WRITTEN.by_sample, _WRITTEN.by_series, _WRITTEN.headers = written, series_written, headers
    return b"".join(lines)
