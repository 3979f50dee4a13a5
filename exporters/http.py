"""The HTTP endpoint Prometheus scrapes: /metrics, /healthz and an index page."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

INDEX_PAGE = b"""<!doctype html><html><head><title>dlprof-agent</title></head><body>
<h1>dlprof-agent</h1><ul>
<li><a href="/metrics">/metrics</a>: Prometheus exposition</li>
<li><a href="/healthz">/healthz</a>: 200 while samples are fresh, 503 when they are not</li>
</ul></body></html>
"""


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # SO_REUSEADDR only skips TIME_WAIT; a port another program listens on still fails.
    allow_reuse_address = True


class MetricsServer:
    """Serves ``registry``. ``health`` returns (healthy, details) for /healthz."""

    def __init__(self, registry: CollectorRegistry, *, host: str, port: int,
                 health: Callable[[], tuple[bool, dict[str, Any]]]) -> None:
        handler = _make_handler(registry, health)
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


def _make_handler(registry: CollectorRegistry,
                  health: Callable[[], tuple[bool, dict[str, Any]]]
                  ) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "dlprof-agent"

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                self._reply(200, content_type, encoder(registry))
            elif path == "/healthz":
                healthy, details = health()
                body = json.dumps({"status": "ok" if healthy else "stale", **details})
                self._reply(200 if healthy else 503, "application/json", body.encode())
            elif path == "/":
                self._reply(200, "text/html; charset=utf-8", INDEX_PAGE)
            else:
                self._reply(404, "text/plain", b"not found: try /metrics or /healthz\n")

        def _reply(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a line per scrape would bury the status display

    return Handler
