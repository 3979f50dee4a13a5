"""The HTTP endpoint Prometheus scrapes: /metrics, /healthz and an index page.

A scrape renders the latest sample at most once per format and encoding: with
``version`` (a value that changes when a new sample is published), the bytes
are kept until the next one, so more scrapers, or scrapes faster than the
sampling, cost no more renders. The classic text format is preferred whenever
the scraper accepts it (Prometheus does, after OpenMetrics): it carries
everything the agent exports, and the agent writes it itself
(``exporters.text``), several times faster than prometheus_client. Payloads are
gzipped when the scraper asks, as Prometheus does.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from dlprof_agent.exporters.text import render_text

INDEX_PAGE = b"""<!doctype html><html><head><title>dlprof-agent</title></head><body>
<h1>dlprof-agent</h1><ul>
<li><a href="/metrics">/metrics</a>: Prometheus exposition</li>
<li><a href="/healthz">/healthz</a>: 200 while samples are fresh, 503 when they are not</li>
</ul></body></html>
"""
GZIP_LEVEL = 1  # most of the size for a fraction of the CPU of the default 9
# Every name the agent exports is a classic one, so the classic text format
# carries it as is, and every Prometheus version reads it.
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # SO_REUSEADDR only skips TIME_WAIT; a port another program listens on still fails.
    allow_reuse_address = True


class MetricsServer:
    """Serves ``registry``. ``health`` returns (healthy, details) for /healthz;
    ``version`` returns what identifies the data the registry renders now."""

    def __init__(self, registry: CollectorRegistry, *, host: str, port: int,
                 health: Callable[[], tuple[bool, dict[str, Any]]],
                 version: Callable[[], object] | None = None) -> None:
        handler = _make_handler(_Renderer(registry, version), health)
        server_class = type("_Server6", (_Server,), {"address_family": socket.AF_INET6}) \
            if ":" in host else _Server
        # Raises OSError (EADDRINUSE, EADDRNOTAVAIL) here, before anything starts.
        self._server = server_class((host, port), handler)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="dlprof-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():  # shutdown() waits forever on a loop never started
            self._server.shutdown()
        self._server.server_close()


def _accepts_text(accept: str) -> bool:
    """Whether the classic text format is acceptable: listed, or no preference."""
    if not accept.strip():
        return True
    for part in accept.split(","):
        media, *parameters = (item.strip() for item in part.split(";"))
        quality = next((p.partition("=")[2] for p in parameters if p.startswith("q=")), "1")
        if media in ("text/plain", "text/*", "*/*") and quality.strip() not in ("0", "0.0"):
            return True
    return False


def render_for(registry: CollectorRegistry, accept: str, gzipped: bool) -> tuple[str, bytes]:
    """The content type and body a scraper sending ``accept`` gets, rendered now."""
    if _accepts_text(accept):
        content_type, body = TEXT_CONTENT_TYPE, render_text(registry)
    else:
        encoder, content_type = choose_encoder(accept)
        body = encoder(registry)
    return content_type, gzip.compress(body, GZIP_LEVEL) if gzipped else body


class _Renderer:
    """The exposition of ``registry`` as bytes, kept per data version."""

    def __init__(self, registry: CollectorRegistry,
                 version: Callable[[], object] | None) -> None:
        self._registry = registry
        self._version = version
        self._lock = threading.Lock()
        self._cached: dict[tuple[str, bool], tuple[object, str, bytes]] = {}

    def render(self, accept: str, gzipped: bool) -> tuple[str, bytes]:
        if self._version is None:
            return render_for(self._registry, accept, gzipped)
        key = ("text" if _accepts_text(accept) else accept, gzipped)
        with self._lock:  # concurrent scrapers wait for one render instead of each doing it
            version = self._version()
            cached = self._cached.get(key)
            if cached is not None and cached[0] is version:
                return cached[1], cached[2]
            content_type, body = render_for(self._registry, accept, gzipped)
            self._cached[key] = (version, content_type, body)
            return content_type, body


def _wants_gzip(accept_encoding: str) -> bool:
    return any(part.split(";")[0].strip() == "gzip" and "q=0" not in part.replace(" ", "")
               for part in accept_encoding.split(","))


def _make_handler(renderer: _Renderer,
                  health: Callable[[], tuple[bool, dict[str, Any]]]
                  ) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "dlprof-agent"

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                gzipped = _wants_gzip(self.headers.get("Accept-Encoding", ""))
                content_type, body = renderer.render(self.headers.get("Accept", ""), gzipped)
                self._reply(200, content_type, body,
                            {"Content-Encoding": "gzip"} if gzipped else {})
            elif path == "/healthz":
                healthy, details = health()
                report = json.dumps({"status": "ok" if healthy else "stale", **details})
                self._reply(200 if healthy else 503, "application/json", report.encode())
            elif path == "/":
                self._reply(200, "text/html; charset=utf-8", INDEX_PAGE)
            else:
                self._reply(404, "text/plain", b"not found: try /metrics or /healthz\n")

        def _reply(self, status: int, content_type: str, body: bytes,
                   headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a line per scrape would bury the status display

    return Handler
