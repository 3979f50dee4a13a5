"""The /metrics server under load: idle and half-sent connections cost no thread
and are closed after the timeout, a hundred scrapers arriving at once are all
answered, and a scraper that leaves mid-answer prints nothing."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dlprof_agent.exporters.http import AGENT_NICE, WORKERS, MetricsServer
from tests.conftest import agent_env, free_port, wait_for

HALF_SENT = 500
SCHED_IDLE = getattr(os, "SCHED_IDLE", 5)
SCHED_OTHER = 0
SCRAPERS = 100


class ManySeries(Collector):
    """About ``count`` series: a payload large enough to outlast a socket buffer."""

    def __init__(self, count: int) -> None:
        self.count = count

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("dlprof_test_value", "A value.", labels=["name"])
        for index in range(self.count):
            family.add_metric([f"series-{index:08d}-with-a-long-label-value"], index)
        yield family


def make_server(series: int = 10, **options: float) -> MetricsServer:
    registry = CollectorRegistry()
    registry.register(ManySeries(series))
    version = object()
    return MetricsServer(registry, host="127.0.0.1", port=0, health=lambda: (True, {}),
                         version=lambda: version, **options)  # type: ignore[arg-type]


def scrape(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        response.read()
        return int(response.status)


@pytest.mark.slow  # a timing window: the request timeout
def test_half_sent_requests_cost_no_threads_and_are_closed_after_the_timeout() -> None:
    server = make_server(request_timeout=2.0)
    server.start()
    threads_serving = threading.active_count()
    clients = []
    try:
        for _ in range(HALF_SENT):
            client = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            client.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never ends
            clients.append(client)
        time.sleep(0.5)
        assert threading.active_count() == threads_serving
        # A real scraper is answered meanwhile: the idle ones hold no worker.
        assert scrape(server.port) == 200
        deadline = time.monotonic() + 30
        for client in clients:
            client.settimeout(max(0.1, deadline - time.monotonic()))
            assert client.recv(1) == b""  # closed by the server, not by our timeout
        assert threading.active_count() == threads_serving
    finally:
        for client in clients:
            client.close()
        server.stop()


def test_the_serving_threads_are_bounded() -> None:
    before = threading.active_count()
    server = make_server()
    server.start()
    try:
        # The I/O thread and the workers, who render too.
        assert threading.active_count() - before == 1 + WORKERS
    finally:
        server.stop()


@pytest.mark.slow  # a timing window for the handshakes
def test_a_hundred_scrapers_arriving_at_once_are_all_answered() -> None:
    """They connect while the server is not yet accepting (as when it is busy): the
    kernel's queue must hold them all, where a backlog of 5 dropped their handshakes.
    (All of them in progress at once: past the default bound they would get 503.)"""
    server = make_server(max_requests=SCRAPERS)
    clients = [socket.socket() for _ in range(SCRAPERS)]
    try:
        for client in clients:
            client.setblocking(False)
            client.connect_ex(("127.0.0.1", server.port))
        time.sleep(1.0)
        for client in clients:
            client.setblocking(True)
            client.settimeout(20)
            client.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        server.start()
        answers = []
        for client in clients:
            reply = b""
            while chunk := client.recv(65536):
                reply += chunk
            answers.append(reply.split(b"\r\n", 1)[0])
        assert answers == [b"HTTP/1.0 200 OK"] * SCRAPERS
        # Accepted by the kernel at once, rather than after SYN retries.
        tcp_info = [client.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
                    for client in clients]
        retransmitted_syns = sum(struct.unpack_from("B", info, 2)[0] for info in tcp_info)
        assert retransmitted_syns == 0
    finally:
        for client in clients:
            client.close()
        server.stop()


@pytest.mark.slow  # a timing window after the resets
def test_a_scraper_that_leaves_mid_answer_prints_no_traceback(
        capfd: pytest.CaptureFixture[str]) -> None:
    server = make_server(series=40000)  # a few MiB: more than the socket buffers hold
    server.start()
    try:
        assert scrape(server.port) == 200  # rendered and kept
        for _ in range(20):
            client = socket.create_connection(("127.0.0.1", server.port))
            client.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            client.recv(10)
            # Reset at once (SO_LINGER 0): the server's writes then fail.
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()
        time.sleep(1.0)
        assert scrape(server.port) == 200
    finally:
        server.stop()
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert "BrokenPipe" not in captured.err and "ConnectionReset" not in captured.err


def scheduling(pid: int) -> dict[int, tuple[int, int]]:
    """Each thread's (nice, policy) from /proc/PID/task/TID/stat (fields 19 and 41)."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            stat = (task / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            found[int(task.name)] = (int(fields[16]), int(fields[38]))
    return found


@pytest.mark.serial  # reads the scheduling of threads that other tests' load could delay
def test_the_agents_threads_yield_to_the_job() -> None:
    """The serving threads (I/O and workers) at nice 10 under the normal policy:
    SCHED_IDLE starved them whenever the job filled every core. The main thread
    (which injects) and the sampler (whose readings of the job's thread states a
    lower priority would bias) left as they were."""
    job = subprocess.Popen(["sleep", "600"])
    port = free_port()
    agent = subprocess.Popen([sys.executable, "-m", "dlprof_agent", "attach", str(job.pid),
                              "--port", str(port), "--quiet", "--no-probe"],
                             env=agent_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    started_nice = os.getpriority(os.PRIO_PROCESS, 0)  # inherited: `nice pytest`
    serving = (max(AGENT_NICE, started_nice), SCHED_OTHER)
    try:
        wait_for(lambda: scrape(port) == 200, "the agent's /metrics")
        # Each serving thread lowers itself as it starts.
        wait_for(lambda: list(scheduling(agent.pid).values()).count(serving) >= 1 + WORKERS,
                 "the serving threads at nice 10")
        # The sampler starts after the server answers; a slow machine shows it later.
        wait_for(lambda: len(scheduling(agent.pid)) >= 2 + 1 + WORKERS, "the sampler thread")
        threads = scheduling(agent.pid)
        assert not any(policy == SCHED_IDLE for _, policy in threads.values())
        assert threads[agent.pid] == (started_nice, SCHED_OTHER)
        if started_nice < AGENT_NICE:  # the sampler too, beside the main thread
            assert list(threads.values()).count((started_nice, SCHED_OTHER)) >= 2
            assert list(threads.values()).count(serving) == 1 + WORKERS
        assert scheduling(job.pid)[job.pid] == (started_nice, SCHED_OTHER)  # untouched
    finally:
        agent.terminate()
        agent.wait(30)
        job.kill()
        job.wait()
