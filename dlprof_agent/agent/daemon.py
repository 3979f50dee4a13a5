"""`dlprof-agent daemon`: one agent per node, for DaemonSets, systemd and SLURM.

The agent's core (core.py) with discovery (discovery.py): it finds the jobs to
watch by itself and reads each as `attach` reads one. The host and the GPUs are
read once per pass for all of them, and all of it is served on one /metrics.
A job that exits is dropped in the same pass; for --grace seconds after,
/metrics keeps its `dlprof_target_up 0` and its probe's final totals
(exit_totals.py), then its series are gone.
"""

from __future__ import annotations

import logging
import sys
import threading

from dlprof_agent.agent.core import Agent
from dlprof_agent.agent.discovery import DaemonOptions, Discovery
from dlprof_agent.agent.endpoint import start_metrics_server
from dlprof_agent.agent.loop import StopRequested, sample_health, sigterm_stops
from dlprof_agent.agent.snapshot_builder import error_log
from dlprof_agent.collectors.host import HostCollector
from dlprof_agent.errors import ExitCode
from dlprof_agent.exporters.admission import MAX_REQUESTS
from dlprof_agent.exporters.prometheus import NodeCollector
from dlprof_agent.exporters.web_config import WebConfig

log = logging.getLogger("dlprof_agent")


def make_daemon(options: DaemonOptions) -> Agent:
    from dlprof_agent.collectors.gpu import GpuCollector

    errors = error_log(gpu=options.gpu, probe=options.probe is not None)
    return Agent(options, chooser=Discovery(options), host=HostCollector(),
                 gpu=GpuCollector(errors=errors) if options.gpu else None, errors=errors)


def serve_node(options: DaemonOptions, listen: str, port: int,
               web_config: WebConfig | None = None, max_requests: int = MAX_REQUESTS) -> int:
    """Run the daemon, serving /metrics on ``listen``:``port``, until SIGTERM or Ctrl-C."""
    daemon = make_daemon(options)
    # The daemon's own loop: healthy while its passes keep coming, whatever one
    # target does; the probes that are stale or dropped are listed, with why.
    health = sample_health(lambda: daemon.latest, options.interval,
                           lambda latest: {"targets": sorted(daemon.targets),
                                           "probes": daemon.probe_report()})
    server = start_metrics_server(
        NodeCollector(lambda: daemon.latest, interval_seconds=options.interval), health,
        listen, port, version=lambda: daemon.latest, web_config=web_config,
        max_requests=max_requests)
    stop = threading.Event()
    try:
        with sigterm_stops():
            log.info("daemon serving http://%s:%d/metrics; looking for jobs every %g s",
                     listen, server.port, options.scan_interval)
            daemon.run(stop)
    except (KeyboardInterrupt, StopRequested) as stopped:
        stop.set()
        daemon.quiet()
        print("dlprof-agent: stopped by "
              f"{'SIGTERM' if isinstance(stopped, StopRequested) else 'Ctrl-C'}",
              file=sys.stderr)
    finally:
        daemon.close()
        server.stop()
    return ExitCode.FINISHED
