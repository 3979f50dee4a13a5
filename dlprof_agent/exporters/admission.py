"""What the /metrics server (``exporters.http``) lets in, and what it turns away
without a worker: the bounds on connections and requests, the short answers that
shed load, and what the I/O thread reads of a request before handing it on.

node_exporter bounds the requests in progress (``--web.max-requests``, 40, then
503); exporter-toolkit caches basic-auth checks so that Prometheus's repeated
credentials cost bcrypt once. Here a request whose credentials are not known yet
waits for one checking thread in a queue of ``AUTH_QUEUE`` (429 beyond), and its
check is skipped if the client has gone meanwhile (``peer_gone``): a flood of new
passwords, each from a client that leaves at once, then costs no check at all.
"""

from __future__ import annotations

import contextlib
import re
import resource
import select
import socket
import ssl

# Of the process's file descriptors, the share idle connections may take: the rest
# stay for the agent's own work (procfs, the probe's sockets), whatever the clients do.
CONNECTIONS_SHARE_OF_FDS = 0.5
# Requests in progress at once, as node_exporter's --web.max-requests (0: no bound).
MAX_REQUESTS = 40
# Requests with credentials not yet checked that may wait for the one bcrypt thread
# (a check costs tens of ms, so a full queue is about half a second of work).
AUTH_QUEUE = 8
_AUTHORIZATION = re.compile(rb"\r\nauthorization:[ \t]*([^\r\n]*)", re.IGNORECASE)


def connection_limit(requested: int) -> int:
    """``requested``, or fewer when the process's file descriptors would not leave
    room for the agent's own work."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested
    return max(16, min(requested, int(soft * CONNECTIONS_SHARE_OF_FDS)))


def peer_gone(sock: socket.socket) -> bool:
    """Whether the client has closed its end (or reset it): it sent its request whole,
    so anything more to read can only be the end of the stream."""
    rdhup = getattr(select, "POLLRDHUP", 0)
    if rdhup:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN | rdhup)
        return any(events & (rdhup | select.POLLHUP | select.POLLERR | select.POLLNVAL)
                   for _, events in poller.poll(0))
    if isinstance(sock, ssl.SSLSocket):
        return False  # no peeking under TLS: the check runs
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def _shed(status: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.0 %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d"
            b"\r\nRetry-After: 1\r\nConnection: close\r\n\r\n%s" % (status, len(body), body))


SHED_BUSY = _shed(b"503 Service Unavailable", b"too many requests now\n")
SHED_LOGINS = _shed(b"429 Too Many Requests", b"too many logins now\n")


def request_path(received: bytes | bytearray) -> bytes:
    """The path a request asks for, without its query; what the handler sees."""
    words = received.split(b"\r\n", 1)[0].split()
    return bytes(words[1].split(b"?", 1)[0]) if len(words) == 3 else b""


def authorization(received: bytes | bytearray) -> str | None:
    """The first Authorization header of a request, as the handler's parser reads it."""
    found = _AUTHORIZATION.search(received.split(b"\r\n\r\n", 1)[0])
    return found.group(1).strip().decode("latin-1") if found else None


def refuse(sock: socket.socket, answer: bytes) -> None:
    """Sends a short ``answer`` without waiting (it fits any socket buffer), and closes."""
    with contextlib.suppress(OSError, ValueError):
        sock.send(answer)
    with contextlib.suppress(OSError):
        sock.close()
