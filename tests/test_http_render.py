"""The /metrics endpoint renders each published sample at most once per format,
prefers the text format when the scraper takes it, and gzips when asked."""

from __future__ import annotations

import gzip
import urllib.request
from collections.abc import Iterable, Iterator

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dlprof_agent.exporters.http import MetricsServer
from tests.helpers import SCRAPE_TIMEOUT_SECONDS

# What Prometheus 2.x sends.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


class CountingCollector(Collector):
    def __init__(self) -> None:
        self.collects = 0
        self.value = 1.0

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        self.collects += 1
        family = GaugeMetricFamily("dlprof_test_value", "A value.")
        family.add_metric([], self.value)
        yield family


@pytest.fixture
def served() -> Iterator[tuple[CountingCollector, list[object], int]]:
    collector, version = CountingCollector(), [object()]
    registry = CollectorRegistry()
    registry.register(collector)
    server = MetricsServer(registry, host="127.0.0.1", port=0, health=lambda: (True, {}),
                           version=lambda: version[0])
    server.start()
    yield collector, version, server.port
    server.stop()


def scrape(port: int, accept: str = PROMETHEUS_ACCEPT, encoding: str = ""
           ) -> tuple[str, str, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    request.add_header("Accept", accept)
    if encoding:
        request.add_header("Accept-Encoding", encoding)
    with urllib.request.urlopen(request, timeout=SCRAPE_TIMEOUT_SECONDS) as response:
        return (response.headers["Content-Type"], response.headers.get("Content-Encoding", ""),
                response.read())


def test_prometheus_gets_the_text_format(served: tuple[CountingCollector, list[object], int]
                                         ) -> None:
    content_type, _, body = scrape(served[2])
    assert content_type.startswith("text/plain; version=0.0.4")
    assert b"dlprof_test_value 1.0" in body


def test_a_scraper_that_takes_only_openmetrics_gets_it(
        served: tuple[CountingCollector, list[object], int]) -> None:
    content_type, _, body = scrape(served[2], accept="application/openmetrics-text")
    assert content_type.startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")


def test_each_sample_is_rendered_once_however_often_it_is_scraped(
        served: tuple[CountingCollector, list[object], int]) -> None:
    collector, version, port = served
    for _ in range(5):
        scrape(port)
    assert collector.collects == 1
    collector.value = 2.0
    version[0] = object()  # a new sample is published
    assert b"dlprof_test_value 2.0" in scrape(port)[2]
    assert collector.collects == 2


def test_gzip_when_asked(served: tuple[CountingCollector, list[object], int]) -> None:
    _, encoding, body = scrape(served[2], encoding="gzip, deflate")
    assert encoding == "gzip"
    assert b"dlprof_test_value 1.0" in gzip.decompress(body)
    _, encoding, body = scrape(served[2], encoding="identity")
    assert encoding == "" and b"dlprof_test_value 1.0" in body
