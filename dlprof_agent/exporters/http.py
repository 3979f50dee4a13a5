"""The HTTP endpoint Prometheus scrapes: /metrics, /healthz and an index page,
optionally behind TLS and basic authentication (``exporters.web_config``).

A fixed set of threads serves it, whatever the load: one I/O thread accepts,
completes TLS handshakes and reads requests whole without blocking, and a few
workers answer complete requests; idle and half-sent connections are closed
after a timeout. The serving threads run at nice 10: the job's threads preempt
them, yet a job that keeps every core busy cannot starve a scrape past
Prometheus's timeout, as SCHED_IDLE (and, through the GIL, nice 19) did.

A scrape renders the latest sample at most once per format and encoding: with
``version`` (a value that changes when a new sample is published), the bytes
are kept until the next one, so more scrapers, or scrapes faster than the
sampling, cost no more renders. The classic text format is preferred whenever
the scraper accepts it (Prometheus does, after OpenMetrics): it carries
everything the agent exports, and the agent writes it itself
(``exporters.text``), several times faster than prometheus_client. Payloads are
gzipped when the scraper asks, as Prometheus does.

What a flood cannot block. At most ``max_requests`` requests are in progress at
once (read whole and not yet answered), as node_exporter's ``--web.max-requests``
bounds them; beyond that the I/O thread answers 503 itself. With basic
authentication, the I/O thread looks the credentials up in a cache of checked
ones (``WebConfig.known``, an HMAC away): a scraper with a good password goes
straight to the workers and never waits on bcrypt, nor behind anyone's request
that needs it. Unchecked credentials join a short queue in front of one checking
thread, or get 429 when it is full, and are dropped unchecked if their client has
already gone; a flood of them costs one core at most and never reaches the
workers. ``/healthz`` never waits on a check: without known credentials it gives
only its verdict. Only exact paths are served, and a request that is not HTTP/1.x gets
505 in plain text. What is let in and what is turned away: ``exporters.admission``.

Kept in one file: the I/O thread, the workers, the checking thread and the request
handler pass one connection among themselves, and the slot it holds among the
requests in progress goes with it; split, each part would reach into the others'
queues and the connection's state.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import io
import itertools
import json
import logging
import os
import queue
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from dlprof_agent.exporters.admission import (
    AUTH_QUEUE,
    MAX_REQUESTS,
    SHED_BUSY,
    SHED_LOGINS,
    authorization,
    connection_limit,
    peer_gone,
    refuse,
    request_path,
)
from dlprof_agent.exporters.text import render_text
from dlprof_agent.exporters.web_config import WebConfig

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


# The kernel's queue of connections not yet accepted: 100 scrapers arriving at once
# overflowed the old 5 (Linux caps it at net.core.somaxconn, 4096 by default).
LISTEN_BACKLOG = 1024
# Threads that answer requests. The I/O thread reads requests until they are whole, so a
# worker never waits on a slow or idle client; the bound is 1 + WORKERS, and 1 checking
# thread with basic authentication.
WORKERS = 2
# A connection that has not sent its whole request this long after it opened (or a
# client that takes this long to read the answer) is closed.
REQUEST_TIMEOUT_SECONDS = 10.0
MAX_CONNECTIONS = 1000  # open at once, besides the listening socket
MAX_REQUEST_BYTES = 65536
# The serving threads' nice value: under contention the job gets about ten times
# their CPU share. Not lower: a thread that waits seconds for a core holds the GIL
# through them, and every other thread of the agent with it.
AGENT_NICE = 10

log = logging.getLogger("dlprof_agent")


def nice_this_thread(nice: int = AGENT_NICE) -> None:
    """Lower the calling thread (and the threads it starts later) to ``nice``. Only
    threads: the thread that injects the probe keeps its priority, because gdb, which
    stops the job while it works, inherits it."""
    with contextlib.suppress(OSError):  # Linux keeps a nice value per thread
        thread = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, thread) < nice:
            os.setpriority(os.PRIO_PROCESS, thread, nice)


@dataclass
class _Connection:
    sock: socket.socket
    address: Any
    deadline: float
    handshaking: bool
    received: bytearray
    authorization: str | None = None  # set when the request waits for a bcrypt check
    verdict: bool | None = None  # the check's answer, once made
    holds_slot: bool = False  # counted among the requests in progress


class MetricsServer:
    """Serves ``registry``. ``health`` returns (healthy, details) for /healthz;
    ``version`` returns what identifies the data the registry renders now;
    ``web_config`` adds TLS and basic authentication (``exporters.web_config``).

    One I/O thread accepts connections, completes TLS handshakes and reads each
    request whole, without blocking; WORKERS threads answer whole requests. So
    idle or half-sent connections cost a socket each and never a thread, and
    are closed after ``request_timeout`` seconds. ``max_requests`` bounds the
    requests in progress (0: no bound); with basic authentication, ``auth_queue``
    bounds those waiting for a bcrypt check."""

    def __init__(self, registry: CollectorRegistry, *, host: str, port: int,
                 health: Callable[[], tuple[bool, dict[str, Any]]],
                 version: Callable[[], object] | None = None,
                 web_config: WebConfig | None = None, workers: int = WORKERS,
                 request_timeout: float = REQUEST_TIMEOUT_SECONDS,
                 max_connections: int = MAX_CONNECTIONS, max_requests: int = MAX_REQUESTS,
                 auth_queue: int = AUTH_QUEUE) -> None:
        self._renderer = _Renderer(registry, version)
        self._scrapes = itertools.count()
        self._scrapes_served = 0
        self._handler = _make_handler(self._renderer, health, web_config, self._count_scrape,
                                      self._check_later)
        self._tls = web_config.tls if web_config is not None else None
        self._web_config = web_config
        self._locked = web_config is not None and web_config.requires_auth
        self._timeout = request_timeout
        self._max_connections = connection_limit(max_connections)
        self._in_progress = threading.BoundedSemaphore(max_requests) if max_requests else None
        self._checks: queue.Queue[_Connection | None] = queue.Queue(max(1, auth_queue))
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # Raises OSError (EADDRINUSE, EADDRNOTAVAIL, gaierror) here, before anything starts.
        self._listener = socket.create_server((host, port), family=family,
                                              backlog=LISTEN_BACKLOG)
        self._listener.setblocking(False)
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._stopping = threading.Event()
        self._requests: queue.SimpleQueue[_Connection | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._serve_io, name="dlprof-http",
                                          daemon=True)]
        self._threads += [threading.Thread(target=self._answer, name=f"dlprof-http-{i}",
                                           daemon=True) for i in range(workers)]
        if web_config is not None and web_config.requires_auth:
            self._threads.append(threading.Thread(target=self._check_credentials,
                                                  name="dlprof-http-auth", daemon=True))

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    @property
    def scrapes(self) -> int:
        """How many times /metrics was served so far."""
        return self._scrapes_served

    def _count_scrape(self) -> None:
        self._scrapes_served = next(self._scrapes) + 1  # count() is atomic under the GIL

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._wake_write.send(b"x")
        for thread in self._threads[1:]:
            if thread.name == "dlprof-http-auth":
                self._checks.put(None)  # it empties the queue, so there is room
            else:
                self._requests.put(None)
        for thread in self._threads:
            if thread.is_alive():
                thread.join(5)
        self._listener.close()
        self._wake_read.close()
        self._wake_write.close()

    # The I/O thread.

    def _serve_io(self) -> None:
        nice_this_thread()
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ, None)
        selector.register(self._wake_read, selectors.EVENT_READ, None)
        open_connections: dict[socket.socket, _Connection] = {}
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                # Idle, it sleeps until a connection or stop() (the wake socket) comes.
                deadline = min((c.deadline for c in open_connections.values()), default=None)
                for key, _ in selector.select(None if deadline is None
                                              else max(0.0, deadline - now)):
                    if key.fileobj is self._listener:
                        self._accept(selector, open_connections)
                    elif key.fileobj is self._wake_read:
                        continue
                    elif key.fileobj not in open_connections:
                        # Made room for a newer one by _accept in this same round:
                        # closed and unregistered already.
                        continue
                    else:
                        connection = key.data
                        if self._progress(connection):
                            selector.unregister(connection.sock)
                            del open_connections[connection.sock]
                            if connection.received:
                                self._dispatch(connection)
                            else:
                                _close(connection.sock)
                now = time.monotonic()
                for connection in [c for c in open_connections.values() if c.deadline <= now]:
                    selector.unregister(connection.sock)
                    del open_connections[connection.sock]
                    _close(connection.sock)
        finally:
            for connection in open_connections.values():
                _close(connection.sock)
            selector.close()

    def _accept(self, selector: selectors.BaseSelector,
                open_connections: dict[socket.socket, _Connection]) -> None:
        while True:
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                if error.errno in (errno.EMFILE, errno.ENFILE) and open_connections:
                    # Out of descriptors: the oldest idle connection makes room.
                    self._drop_oldest(selector, open_connections)
                    continue
                # Nothing of ours to close: the queued connection waits for later, and
                # the listener, readable all along, must not spin this thread meanwhile.
                time.sleep(0.05)
                return
            if len(open_connections) >= self._max_connections:
                # Full: the oldest connection (the likeliest to be stuck) makes room.
                self._drop_oldest(selector, open_connections)
            sock.setblocking(False)
            handshaking = False
            if self._tls is not None:
                try:
                    sock = self._tls.wrap_socket(sock, server_side=True,
                                                 do_handshake_on_connect=False)
                except (ssl.SSLError, OSError):
                    _close(sock)
                    continue
                handshaking = True
            connection = _Connection(sock, address, time.monotonic() + self._timeout,
                                     handshaking, bytearray())
            open_connections[sock] = connection
            selector.register(sock, selectors.EVENT_READ, connection)

    def _dispatch(self, connection: _Connection) -> None:
        """Hands a whole request on: to the checking thread when its credentials need a
        bcrypt check (429 when its queue is full), else to the workers."""
        if self._locked and request_path(connection.received) != b"/healthz":
            assert self._web_config is not None
            credentials = authorization(connection.received)
            verdict = self._web_config.known(credentials)
            if verdict is None:
                connection.authorization = credentials
                if not self._check_later(connection):
                    refuse(connection.sock, SHED_LOGINS)
                return
            connection.verdict = verdict
        self._to_workers(connection)

    def _to_workers(self, connection: _Connection) -> None:
        """Queues ``connection`` for a worker, or answers 503 when ``max_requests`` are
        in progress already."""
        if not connection.holds_slot:
            if self._in_progress is not None and not self._in_progress.acquire(
                    blocking=False):
                refuse(connection.sock, SHED_BUSY)
                return
            connection.holds_slot = True
        self._requests.put(connection)

    @staticmethod
    def _drop_oldest(selector: selectors.BaseSelector,
                     open_connections: dict[socket.socket, _Connection]) -> None:
        oldest = next(iter(open_connections.values()))  # dicts keep the order of accepts
        selector.unregister(oldest.sock)
        del open_connections[oldest.sock]
        _close(oldest.sock)

    def _progress(self, connection: _Connection) -> bool:
        """Reads what arrived; True once the request is whole, or the connection is done
        (an empty ``received`` then means: close it)."""
        sock = connection.sock
        try:
            if connection.handshaking:
                assert isinstance(sock, ssl.SSLSocket)
                sock.do_handshake()
                connection.handshaking = False
            while True:
                chunk = sock.recv(16384)
                if not chunk:
                    connection.received.clear()  # closed before the request was whole
                    return True
                connection.received += chunk
                if b"\r\n\r\n" in connection.received or \
                        len(connection.received) >= MAX_REQUEST_BYTES:
                    return True
                if not (isinstance(sock, ssl.SSLSocket) and sock.pending()):
                    return False
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
            return False  # a TLS client waiting on us for writes is rare; the deadline holds
        except (ssl.SSLError, OSError):
            connection.received.clear()
            return True

    # The workers.

    def _answer(self) -> None:
        nice_this_thread()
        while True:
            connection = self._requests.get()
            if connection is None:
                return
            sock = connection.sock
            done = True
            try:
                sock.settimeout(self._timeout)  # for the answer: a client that never reads
                done = self._handler(connection)
            except (OSError, ValueError):
                pass  # the scraper left (broken pipe, reset, timeout): nothing to tell
            except Exception:  # a bug: said once per occurrence, without killing the worker
                log.exception("serving a request failed")
            finally:
                if done:
                    self._finish(connection)

    def _finish(self, connection: _Connection) -> None:
        _close(connection.sock)
        if connection.holds_slot and self._in_progress is not None:
            connection.holds_slot = False
            self._in_progress.release()

    def _check_later(self, connection: _Connection) -> bool:
        """Queues ``connection`` for a bcrypt check; False when the queue is full."""
        try:
            self._checks.put_nowait(connection)
        except queue.Full:
            return False
        return True

    # The checking thread: one, so that a flood costs at most one core.

    def _check_credentials(self) -> None:
        nice_this_thread()
        assert self._web_config is not None
        while True:
            connection = self._checks.get()
            if connection is None:
                return
            if self._stopping.is_set() or peer_gone(connection.sock):
                self._finish(connection)  # nobody to answer: no check
                continue
            try:
                connection.verdict = self._web_config.authorized(connection.authorization)
            except Exception:  # a bug: said once per occurrence, without killing the thread
                log.exception("checking credentials failed")
                connection.verdict = False
            if self._stopping.is_set():
                self._finish(connection)  # the workers may have gone
            else:
                self._to_workers(connection)  # a worker answers, knowing the verdict


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


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


# Answers a connection's request; False when it handed the connection on (to the
# bcrypt queue) instead of answering, so that it must stay open.
Handler = Callable[[_Connection], bool]


def _make_handler(renderer: _Renderer,
                  health: Callable[[], tuple[bool, dict[str, Any]]],
                  web_config: WebConfig | None, on_scrape: Callable[[], None],
                  check_later: Callable[[_Connection], bool]) -> Handler:
    extra_headers = dict(web_config.headers) if web_config is not None else {}
    locked = web_config is not None and web_config.requires_auth

    class RequestHandler(BaseHTTPRequestHandler):
        """Answers one request that the I/O thread read whole (``received``)."""

        # Errors (400, 501, 505) in plain text: no HTML page for a scanner to read.
        error_message_format = "%(code)d %(message)s\n"
        error_content_type = "text/plain; charset=utf-8"
        # What an error before the version is known is written as: with a status line
        # (the standard library's default, HTTP/0.9, has none).
        default_request_version = "HTTP/1.0"

        def __init__(self, connection: _Connection) -> None:
            self._connection = connection
            self._received = bytes(connection.received)
            self.handed_on = False
            super().__init__(connection.sock, connection.address, None)  # type: ignore[arg-type]

        def setup(self) -> None:
            self.connection = self.request
            self.rfile = io.BytesIO(self._received)
            self.wfile = self.connection.makefile("wb")

        def finish(self) -> None:
            try:
                self.wfile.flush()
            finally:
                self.wfile.close()
                self.rfile.close()

        def version_string(self) -> str:
            return "dlprof-agent"  # no Python version: nothing for a scanner to match

        def parse_request(self) -> bool:
            if len(getattr(self, "raw_requestline", b"").split()) == 2:
                return False  # HTTP/0.9, which has no status line: closed unanswered
            if not super().parse_request():
                return False  # answered (400, 505) with a status line: see the default
            if not self.request_version.startswith("HTTP/1."):
                self.request_version = self.default_request_version
                self.send_error(505, "only HTTP/1.x is served")
                return False
            # The target as sent: parse_request folds a leading "//" into "/", and only
            # exact paths are served.
            self.path = self.requestline.split()[1]
            return True

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            allowed: bool | None = True
            if locked:
                assert web_config is not None
                allowed = self._connection.verdict
                if allowed is None:
                    allowed = web_config.known(self.headers.get("Authorization"))
            if path == "/healthz":
                healthy, details = health()
                # Without credentials, only the verdict: a liveness probe needs no more.
                report = {"status": "ok" if healthy else "stale", **(details if allowed
                                                                      else {})}
                self._reply(200 if healthy else 503, "application/json",
                            json.dumps(report).encode())
            elif allowed is None:  # the I/O thread read the header otherwise: rare
                self._connection.authorization = self.headers.get("Authorization")
                if check_later(self._connection):
                    self.handed_on = True
                    self.close_connection = True
                else:
                    self.wfile.write(SHED_LOGINS)
            elif not allowed:
                self._reply(401, "text/plain; charset=utf-8", b"Unauthorized\n",
                            {"WWW-Authenticate": 'Basic realm="dlprof-agent"'})
            elif path == "/metrics":
                gzipped = _wants_gzip(self.headers.get("Accept-Encoding", ""))
                content_type, body = renderer.render(self.headers.get("Accept", ""), gzipped)
                self._reply(200, content_type, body,
                            {"Content-Encoding": "gzip"} if gzipped else {})
                on_scrape()
            elif path == "/":
                self._reply(200, "text/html; charset=utf-8", INDEX_PAGE)
            else:
                self._reply(404, "text/plain", b"not found: try /metrics or /healthz\n")

        def _reply(self, status: int, content_type: str, body: bytes,
                   headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            for name, value in {**extra_headers, **(headers or {})}.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a line per scrape would bury the status display

    def answer(connection: _Connection) -> bool:
        return not RequestHandler(connection).handed_on

    return answer
