"""The /metrics endpoint of `attach`, `run`, `demo` and `daemon`: its web
configuration checked before anything starts, and a started server, or a
one-line error that says why there is none."""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
from collections.abc import Callable

from dlprof_agent.agent.loop import Health
from dlprof_agent.errors import (
    DlprofError,
    MissingLibrary,
    PortUnavailable,
    UsageError,
    WebConfigError,
)
from dlprof_agent.exporters.admission import MAX_REQUESTS
from dlprof_agent.exporters.http import MetricsServer
from dlprof_agent.exporters.prometheus import NodeCollector, registry_of
from dlprof_agent.exporters.web_config import WebConfig
from dlprof_agent.exporters.web_config import load as read_web_config

DEFAULT_PORT = 9945  # clear of node_exporter 9100, process-exporter 9256, dcgm-exporter 9400
DEFAULT_LISTEN = "127.0.0.1"

log = logging.getLogger("dlprof_agent")


def load_web_config(path: str | None) -> WebConfig | None:
    """--web.config.file, read and checked before anything starts."""
    if path is None:
        return None
    try:
        return read_web_config(path)
    except MissingLibrary as error:
        raise UsageError(f"--web.config.file: {error}") from None
    except WebConfigError as error:
        raise UsageError(f"--web.config.file: {error}",
                         "see \"Locking /metrics\" in docs/deploy.md") from None


def _loopback(listen: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(listen, None))
    except (OSError, ValueError):
        return False


def _cannot_listen(listen: str, port: int, error: OSError) -> DlprofError:
    """The one-line error for a listening socket that could not be had."""
    if isinstance(error, socket.gaierror):
        return UsageError(f"cannot listen on {listen!r}: not an address of this machine",
                          "use e.g. --listen 127.0.0.1 or --listen 0.0.0.0")
    where = f"{listen}:{port}"
    if error.errno == errno.EADDRINUSE:
        return PortUnavailable(f"port {port} on {listen} is already in use",
                               f"pick another with --port, e.g. --port {port + 1}")
    if error.errno == errno.EACCES:
        return PortUnavailable(f"no permission to listen on {where}",
                               f"ports below 1024 need root; use e.g. --port {DEFAULT_PORT}")
    return UsageError(f"cannot listen on {where}: {error.strerror}", "check --listen and --port")


def check_can_listen(listen: str, port: int) -> None:
    """Raise the error serving would meet on ``listen``:``port``, before anything is
    started (`run` checks before it starts the job, so a busy port costs the job
    nothing). Port 0 (any free one) always works."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in listen else socket.AF_INET
    try:
        socket.create_server((listen, port), family=family).close()
    except OSError as error:
        raise _cannot_listen(listen, port, error) from None


def start_metrics_server(collector: NodeCollector, health: Health,
                         listen: str, port: int, *,
                         version: Callable[[], object] | None = None,
                         web_config: WebConfig | None = None,
                         max_requests: int = MAX_REQUESTS) -> MetricsServer:
    """A started /metrics server, or a one-line error saying why there is none.
    ``version``: the published sample; a scrape renders each one at most once.
    ``max_requests``: --web.max-requests, the requests in progress at once (0: no bound)."""
    try:
        server = MetricsServer(registry_of(collector), host=listen, port=port, health=health,
                               version=version, web_config=web_config,
                               max_requests=max_requests)
    except OSError as error:
        raise _cannot_listen(listen, port, error) from None
    if web_config is None and not _loopback(listen):
        log.warning("serving /metrics on %s without TLS or authentication: anyone who can "
                    "reach this port reads it (see --web.config.file)", listen)
    server.start()
    return server
