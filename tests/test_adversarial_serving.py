"""Attacks on the endpoint of a real `dlprof-agent attach`, with basic auth as
production sets it up (bcrypt at cost 10): a flood of wrong passwords, each from a
client that leaves at once, and 1,500 half-open connections. Through both, a
scraper with the password is answered within a second, and /healthz too.

The figures (latency percentiles, the agent's CPU seconds and file descriptors)
are printed (`pytest -s`); docs/security.md quotes them.
"""

from __future__ import annotations

import base64
import os
import resource
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import agent_env, free_port, spawn, stop, wait_for

bcrypt = pytest.importorskip("bcrypt", reason="bcrypt is not installed: "
                             "pip install 'dlprof-agent[web]'")
pytestmark = pytest.mark.slow

PASSWORD = "the scraper's password"
FLOOD_SECONDS = 10
FLOOD_PER_SECOND = 200
AFTER_SECONDS = 5  # valid scrapes go on this long after the flood
HALF_OPEN = 1500
ANSWER_WITHIN_SECONDS = 1.0
# The agent's soft limit on open files: 1,500 connections exceed it. Systemd's and
# most shells' default is 1,024, of which a daemon with a few dozen GPU, /proc and
# probe descriptors of its own leaves about this many for connections.
AGENT_OPEN_FILES = 1000
CLIENT_TIMEOUT_SECONDS = 10.0


@dataclass
class Agent:
    process: subprocess.Popen[bytes]
    port: int

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))


@dataclass
class Timings:
    seconds: list[float] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)

    def summary(self) -> str:
        ordered = sorted(self.seconds)
        p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        return (f"n={len(ordered)} p50={statistics.median(ordered) * 1000:.1f} ms "
                f"p95={p95 * 1000:.1f} ms max={ordered[-1] * 1000:.1f} ms "
                f"statuses={sorted(set(self.statuses))}")


def basic(password: str) -> str:
    return "Basic " + base64.b64encode(f"prometheus:{password}".encode()).decode()


def request(path: str, password: str | None = None) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1"]
    if password is not None:
        lines.append(f"Authorization: {basic(password)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def timed_get(port: int, path: str, password: str | None, into: Timings) -> None:
    """One request from connect to the last byte; a timeout counts as status 0."""
    start = time.monotonic()
    answer = 0
    try:
        with socket.create_connection(("127.0.0.1", port),
                                      timeout=CLIENT_TIMEOUT_SECONDS) as client:
            client.sendall(request(path, password))
            reply = b""
            while chunk := client.recv(65536):
                reply += chunk
            answer = int(reply.split(b" ", 2)[1]) if reply else 0
    except OSError:
        pass
    into.seconds.append(time.monotonic() - start)
    into.statuses.append(answer)


@pytest.fixture
def open_files() -> Iterator[Callable[[int], None]]:
    """Raises this process's soft limit on open files for the test's clients, or skips
    the test with the reason; the limit is restored after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def at_least(needed: int) -> None:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"the hard limit on open files is {hard}; the test's clients "
                        f"need {needed}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))

    yield at_least
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()
    config = tmp_path / "web-config.yml"
    config.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    job = spawn([sys.executable, "-m", "dlprof_agent.workloads.busy", "--threads", "1",
                 "--duty", "0.2"])
    assert job.stdout is not None
    job.stdout.readline()  # it prints once its threads run
    port = free_port()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = AGENT_OPEN_FILES if hard == resource.RLIM_INFINITY else min(AGENT_OPEN_FILES, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))  # the agent inherits it
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", "dlprof_agent", "attach", str(job.pid), "--port", str(port),
             "--interval", "0.5", "--quiet", "--no-probe", "--web.config.file", str(config)],
            env=agent_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        served = Agent(process, port)
        warm = Timings()

        def scraped() -> bool:
            timed_get(port, "/metrics", PASSWORD, warm)
            return warm.statuses[-1] == 200

        wait_for(scraped, "a first scrape with the password")
        yield served
    finally:
        stop(process)
        stop(job)
        if process.stderr is not None:
            process.stderr.close()


def flood(port: int, sent: list[int], until: threading.Event, leave: bool) -> None:
    """FLOOD_PER_SECOND requests a second, each with a new wrong password, each from
    a client that closes as soon as it has sent it (``leave``), or that stays until
    the flood ends."""
    start = time.monotonic()
    staying = []
    try:
        for index in range(FLOOD_SECONDS * FLOOD_PER_SECOND):
            pause = start + index / FLOOD_PER_SECOND - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            try:
                client = socket.create_connection(("127.0.0.1", port), timeout=1)
                client.sendall(request("/metrics", f"wrong {secrets.token_hex(8)}"))
                sent[0] += 1
            except OSError:
                sent[1] += 1
                continue
            if leave:
                client.close()
            else:
                staying.append(client)
    finally:
        for client in staying:
            client.close()
        until.set()


def watch_fds(agent: Agent, peak: list[int], until: threading.Event) -> None:
    while not until.is_set():
        peak[0] = max(peak[0], agent.fds())
        until.wait(0.1)


@pytest.mark.serial  # each scrape's latency, which other tests' load would add to
@pytest.mark.parametrize("leave", [True, False], ids=["clients-leave", "clients-stay"])
def test_a_flood_of_wrong_passwords_leaves_the_endpoint_answering(
        agent: Agent, open_files: Callable[[int], None], leave: bool) -> None:
    """Clients that leave cost no check; clients that stay cost one core at most
    (one checking thread), and those past its queue are turned away at once."""
    if not leave:
        open_files(FLOOD_SECONDS * FLOOD_PER_SECOND + 256)
    cpu_before = agent.cpu_seconds()
    sent = [0, 0]  # sent, failed to connect
    flooded, done = threading.Event(), threading.Event()
    peak = [agent.fds()]
    threads = [threading.Thread(target=flood, args=(agent.port, sent, flooded, leave)),
               threading.Thread(target=watch_fds, args=(agent, peak, done))]
    for thread in threads:
        thread.start()
    during, after, health = Timings(), Timings(), Timings()
    start = time.monotonic()
    try:
        for second in range(FLOOD_SECONDS + AFTER_SECONDS):
            pause = start + second - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            timed_get(agent.port, "/metrics", PASSWORD,
                      after if flooded.is_set() else during)
            timed_get(agent.port, "/healthz", None, health)
    finally:
        flooded.wait(60)
        done.set()
        for thread in threads:
            thread.join(60)
    cpu = agent.cpu_seconds() - cpu_before
    elapsed = time.monotonic() - start
    print(f"\nauth flood ({'clients leave' if leave else 'clients stay'}): {sent[0]} "
          f"wrong passwords sent ({sent[1]} refused connects) "
          f"in {FLOOD_SECONDS} s; scrapes during: {during.summary()}; after: "
          f"{after.summary()}; /healthz: {health.summary()}; agent CPU {cpu:.2f} s in "
          f"{elapsed:.0f} s; peak fds {peak[0]}")
    assert sent[0] >= FLOOD_SECONDS * FLOOD_PER_SECOND * 0.9
    for timings in (during, after, health):
        assert timings.statuses == [200] * len(timings.statuses), timings
        assert max(timings.seconds) < ANSWER_WITHIN_SECONDS, timings
    assert after.seconds  # the flood ended before the scrapes did


@pytest.mark.serial  # each scrape's latency, which other tests' load would add to
def test_half_open_connections_leave_the_endpoint_answering(
        agent: Agent, open_files: Callable[[int], None]) -> None:
    open_files(HALF_OPEN + 256)
    clients: list[socket.socket] = []
    scrapes, health = Timings(), Timings()
    try:
        for index in range(HALF_OPEN):
            client = socket.create_connection(("127.0.0.1", agent.port), timeout=5)
            if index % 2:  # a slow client: headers that never end
                client.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            clients.append(client)
        fds = agent.fds()
        for _ in range(5):
            timed_get(agent.port, "/metrics", PASSWORD, scrapes)
            timed_get(agent.port, "/healthz", None, health)
    finally:
        for client in clients:
            client.close()
    print(f"\nhalf-open: {HALF_OPEN} connections; agent fds {fds} (open-file limit "
          f"{AGENT_OPEN_FILES}); scrapes: {scrapes.summary()}; /healthz: {health.summary()}")
    for timings in (scrapes, health):
        assert timings.statuses == [200] * len(timings.statuses), timings
        assert max(timings.seconds) < ANSWER_WITHIN_SECONDS, timings
