"""What bounds the /metrics server under a flood, in process: password checks wait
in a bounded queue and never hold a worker, a client that has left is not checked,
known credentials and /healthz are answered while the check is busy, requests in
progress are bounded (503 beyond), idle connections leave file descriptors for the
agent; and the edges: exact paths only, plain-text 505 for anything but HTTP/1.x,
control characters in label values replaced."""

from __future__ import annotations

import base64
import resource
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from dlprof_agent.exporters import web_config
from dlprof_agent.exporters.admission import AUTH_QUEUE, connection_limit
from dlprof_agent.exporters.http import MetricsServer
from dlprof_agent.exporters.text import render_text
from tests.conftest import PROMTOOL, agent_env, wait_for

bcrypt = pytest.importorskip("bcrypt", reason="bcrypt is not installed: "
                             "pip install 'dlprof-agent[web]'")
PASSWORD = "good one"


class Gauge:
    """One gauge; its collect() waits for ``opened`` when one is given."""

    def __init__(self, label: str = "x", opened: threading.Event | None = None) -> None:
        self.label = label
        self.opened = opened

    def collect(self) -> Iterator[Metric]:
        if self.opened is not None:
            assert self.opened.wait(30)
        family = GaugeMetricFamily("dlprof_test_value", "A value.", labels=["name"])
        family.add_metric([self.label], 1.0)
        yield family


def basic(password: str, user: str = "prometheus") -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def request(port: int, path: str = "/metrics", authorization: str | None = None) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1"]
    if authorization:
        lines.append(f"Authorization: {authorization}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def exchange(port: int, raw: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as client:
        client.sendall(raw)
        return read_all(client)


def read_all(client: socket.socket) -> bytes:
    reply = b""
    while chunk := client.recv(65536):
        reply += chunk
    return reply


def status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


@pytest.fixture
def locked(tmp_path: Path) -> web_config.WebConfig:
    hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
    (tmp_path / "web.yml").write_text(f"basic_auth_users: {{prometheus: '{hashed}'}}\n")
    return web_config.load(tmp_path / "web.yml")


class GatedChecks:
    """Stands in front of WebConfig.authorized: each check waits until ``opened``,
    and the checks that ran are counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = threading.Event()
        self.started = 0
        check = web_config.WebConfig.authorized

        def gated(config: web_config.WebConfig, authorization: str | None) -> bool:
            if config.known(authorization) is None:
                self.started += 1
                assert self.opened.wait(30)
            return check(config, authorization)

        monkeypatch.setattr(web_config.WebConfig, "authorized", gated)


def serve(config: web_config.WebConfig | None = None, **options: int) -> MetricsServer:
    registry = CollectorRegistry()
    registry.register(Gauge())
    version = object()
    server = MetricsServer(registry, host="127.0.0.1", port=0,
                           health=lambda: (True, {"detail": "here"}), version=lambda: version,
                           web_config=config, **options)
    server.start()
    return server


def test_known_credentials_and_healthz_never_wait_for_a_password_check(
        locked: web_config.WebConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    assert locked.authorized(basic(PASSWORD))  # the scraper's, checked before
    checks = GatedChecks(monkeypatch)
    server = serve(locked)
    waiting = []
    try:
        # One check runs (held), AUTH_QUEUE wait; the one after is turned away at once.
        for index in range(AUTH_QUEUE + 1):
            client = socket.create_connection(("127.0.0.1", server.port), timeout=20)
            client.sendall(request(server.port, authorization=basic(f"wrong {index}")))
            waiting.append(client)
            if index == 0:
                wait_for(lambda: checks.started == 1, "the first check to start")
        wait_for(server._checks.full, "the queue of checks to fill")
        refused = exchange(server.port, request(server.port, authorization=basic("one more")))
        assert status(refused) == 429
        assert b"Retry-After: 1" in refused
        # Meanwhile the known scraper is served, and /healthz answers with its details.
        assert status(exchange(server.port, request(server.port,
                                                    authorization=basic(PASSWORD)))) == 200
        health = exchange(server.port, request(server.port, "/healthz", basic(PASSWORD)))
        assert status(health) == 200 and b'"detail": "here"' in health
        # Unknown credentials get the verdict only, without waiting for a check.
        health = exchange(server.port, request(server.port, "/healthz", basic("unchecked")))
        assert status(health) == 200 and b"detail" not in health
        checks.opened.set()
        assert [status(read_all(client)) for client in waiting] == [401] * len(waiting)
    finally:
        checks.opened.set()
        for client in waiting:
            client.close()
        server.stop()


def test_a_client_that_has_left_is_not_checked(
        locked: web_config.WebConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    checks = GatedChecks(monkeypatch)
    server = serve(locked)
    try:
        held = socket.create_connection(("127.0.0.1", server.port), timeout=20)
        held.sendall(request(server.port, authorization=basic("held")))
        wait_for(lambda: checks.started == 1, "the first check to start")
        for index in range(AUTH_QUEUE):  # each sends its request and leaves at once
            with socket.create_connection(("127.0.0.1", server.port)) as client:
                client.sendall(request(server.port, authorization=basic(f"gone {index}")))
        wait_for(server._checks.full, "the requests of the gone clients to queue")
        checks.opened.set()
        assert status(read_all(held)) == 401
        held.close()
        # Queued behind the gone ones, so checked after they were dropped.
        last = exchange(server.port, request(server.port, authorization=basic("last")))
        assert status(last) == 401
        assert checks.started == 2
    finally:
        checks.opened.set()
        server.stop()


def test_a_flood_of_wrong_passwords_does_not_push_out_the_good_one(
        locked: web_config.WebConfig) -> None:
    assert locked.authorized(basic(PASSWORD))
    for index in range(web_config.CHECKS_KEPT + 10):
        assert not locked.authorized(basic(f"wrong {index}"))
    assert locked.known(basic(PASSWORD)) is True


def test_the_cache_holds_no_key_another_process_could_match(
        locked: web_config.WebConfig, tmp_path: Path) -> None:
    """The same credentials, checked by two loads of the same file, are kept under
    different keys: what the cache holds says nothing outside its process."""
    other = web_config.load(tmp_path / "web.yml")
    for config in (locked, other):
        assert config.authorized(basic(PASSWORD))
    assert set(locked._granted).isdisjoint(other._granted)
    assert PASSWORD.encode() not in b"".join(locked._granted)


def test_requests_in_progress_are_bounded_and_the_rest_get_503() -> None:
    opened = threading.Event()
    registry = CollectorRegistry()
    registry.register(Gauge(opened=opened))
    server = MetricsServer(registry, host="127.0.0.1", port=0, health=lambda: (True, {}),
                           max_requests=2)
    server.start()
    held = []
    try:
        for _ in range(2):  # both workers wait for the render
            client = socket.create_connection(("127.0.0.1", server.port), timeout=20)
            client.sendall(request(server.port))
            held.append(client)
        # Whichever of the three gets there last is turned away; wait for one 503.
        refused = wait_for(lambda: (reply := exchange(server.port, request(server.port)))
                           and status(reply) == 503 and reply, "a 503")
        assert b"Retry-After: 1" in refused
        opened.set()
        assert [status(read_all(client)) for client in held] == [200, 200]
        # A worker closes its connection, then gives its slot back: a client that read
        # to the end may ask again first and be turned away. Both slots come back.
        wait_for(lambda: status(exchange(server.port, request(server.port))) == 200,
                 "a 200 once the held requests have ended")
    finally:
        opened.set()
        for client in held:
            client.close()
        server.stop()


def test_idle_connections_leave_half_the_file_descriptors_to_the_agent() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        assert connection_limit(1000) == 128
        assert connection_limit(100) == 100
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("raw", [b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
                                 b"GET /metrics HTTP/9.9\r\n\r\n",
                                 b"GET /metrics HTTP/0.9\r\n\r\n"])
def test_anything_but_http_1_gets_a_plain_505(raw: bytes) -> None:
    server = serve()
    try:
        reply = exchange(server.port, raw)
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 505 ")
        assert b"Content-Type: text/plain" in head
        assert b"<" not in body
    finally:
        server.stop()


def test_a_request_without_a_version_is_closed_unanswered() -> None:
    server = serve()
    try:
        assert exchange(server.port, b"GET /metrics\r\n\r\n") == b""
    finally:
        server.stop()


@pytest.mark.parametrize("path", ["//metrics", "///metrics", "//healthz", "/metrics/"])
def test_only_exact_paths_are_served(path: str) -> None:
    server = serve()
    try:
        assert status(exchange(server.port, request(server.port, path))) == 404
        assert status(exchange(server.port, request(server.port, "/metrics?x=1"))) == 200
    finally:
        server.stop()


def test_control_characters_in_label_values_are_replaced() -> None:
    registry = CollectorRegistry()
    registry.register(Gauge('nul\x00soh\x01del\x7fcr\rtab\tnl\nquote"back\\slash é'))
    text = render_text(registry)
    assert not any((byte < 0x20 and byte != 0x0A) or byte == 0x7F for byte in text)
    [family] = text_string_to_metric_families(text.decode())
    assert family.samples[0].labels["name"] == (
        'nul\ufffdsoh\ufffddel\ufffdcr\ufffdtab\ufffdnl\nquote"back\\slash é')
    if PROMTOOL is not None:  # Prometheus's own parser reads it too
        checked = subprocess.run([PROMTOOL, "check", "metrics"], input=text,
                                 capture_output=True, timeout=60, check=False)
        assert b"error" not in checked.stdout + checked.stderr.lower(), checked


def test_the_commands_that_serve_take_web_max_requests() -> None:
    for command in ("attach", "run", "demo", "daemon"):
        shown = subprocess.run([sys.executable, "-m", "dlprof_agent", command, "--help"],
                               env=agent_env(), capture_output=True, text=True, timeout=60,
                               check=False)
        assert "--web.max-requests N" in shown.stdout, command
    refused = subprocess.run([sys.executable, "-m", "dlprof_agent", "daemon",
                              "--web.max-requests", "-1"], env=agent_env(),
                             capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2
    assert "--web.max-requests" in refused.stderr and "out of range" in refused.stderr
