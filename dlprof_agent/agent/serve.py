"""`attach`: the agent wired for one target (sampler, probe, /metrics endpoint,
live status) and served until the duration, Ctrl-C, SIGTERM or the target's
exit; and `snapshot`, the same sampler read once."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from dlprof_agent.agent.endpoint import start_metrics_server
from dlprof_agent.agent.loop import StopRequested, sample_health, sigterm_stops
from dlprof_agent.agent.sampler import Sampler
from dlprof_agent.agent.snapshot_builder import PROBE_DEADLINE_SECONDS, error_log
from dlprof_agent.agent.status import LiveStatus, Summary, configure_logging
from dlprof_agent.collectors.gpu import GpuCollector
from dlprof_agent.collectors.host import HostCollector
from dlprof_agent.collectors.limits import LimitsCollector
from dlprof_agent.collectors.process import ProcessCollector
from dlprof_agent.collectors.target import Target, open_target
from dlprof_agent.errors import ExitCode, TargetGone, TargetNotFound
from dlprof_agent.exporters.admission import MAX_REQUESTS
from dlprof_agent.exporters.http import MetricsServer
from dlprof_agent.exporters.prometheus import SnapshotCollector
from dlprof_agent.exporters.text import render_text
from dlprof_agent.exporters.web_config import WebConfig
from dlprof_agent.model.findings.tracker import FindingsTracker
from dlprof_agent.model.snapshot import Snapshot
from dlprof_agent.probe_link.channel import DEFAULT_TIMEOUTS, ChannelTimeouts
from dlprof_agent.probe_link.connect import ProbeOptions
from dlprof_agent.probe_link.exchanges import ReportsCondition
from dlprof_agent.probe_link.series_budget import DEFAULT_TARGET_SERIES, SeriesBudget
from dlprof_agent.probe_link.start import ProbeStart

DEFAULT_INTERVAL_SECONDS = 1.0
DEFAULT_GRACE_SECONDS = 15.0  # one scrape at Prometheus's usual 15 s interval
DEFAULT_WARMUP_STEPS = 10
MIN_INTERVAL_SECONDS = 0.05
STOP_PASS_SECONDS = 2.0  # how long a stop waits for the pass under way to end

log = logging.getLogger("dlprof_agent")


@dataclass(frozen=True)
class ServeOptions:
    listen: str
    port: int
    interval: float
    duration: float | None
    grace: float
    quiet: bool
    children: bool
    gpu: bool
    probe: ProbeOptions | None = None  # None: never talk to the process
    probe_wait_seconds: float = 0.0  # `run`: the probe appears once Python has started
    web_config: WebConfig | None = None  # --web.config.file, loaded
    channel: ChannelTimeouts = DEFAULT_TIMEOUTS  # how long the probe's channel waits
    max_series_per_target: int = DEFAULT_TARGET_SERIES  # --max-series-per-target
    max_requests: int = MAX_REQUESTS  # --web.max-requests
    node_name: str = ""  # --node-name, resolved: dlprof_target_info's node


def make_sampler(pid: int, *, interval: float, children: bool, gpu: bool,
                 probe: bool = False,
                 max_series: int = DEFAULT_TARGET_SERIES,
                 probe_deadline_seconds: float = PROBE_DEADLINE_SECONDS,
                 node_name: str = "") -> Sampler:
    errors = error_log(gpu=gpu, probe=probe)
    gpu_collector = None
    if gpu:
        gpu_collector = GpuCollector(errors=errors)
    try:
        processes = ProcessCollector(Target.of(pid), children=children, errors=errors)
    except TargetGone as error:  # gone since open_target checked it
        raise TargetNotFound(f"process {pid} exited while the agent was starting",
                             "attach to a running job") from error
    return Sampler(target_pid=pid, processes=processes, host=HostCollector(),
                   gpu=gpu_collector, errors=errors, interval_seconds=interval,
                   limits=LimitsCollector(processes.target), findings=FindingsTracker(),
                   budget=SeriesBudget(per_target=max_series),
                   probe_deadline_seconds=probe_deadline_seconds, node_name=node_name)


def _first_sample(sampler: Sampler) -> Snapshot:
    snapshot = sampler.sample_once()
    if not snapshot.target_up:
        raise TargetNotFound(f"process {sampler.target_pid} exited while the agent was "
                             "starting", "attach to a running job")
    return snapshot


def _collector(sampler: Sampler) -> SnapshotCollector:
    return SnapshotCollector(lambda: sampler.latest, interval_seconds=sampler.interval_seconds)


def _start_server(sampler: Sampler, options: ServeOptions,
                  starting: Callable[[], str] = lambda: "") -> MetricsServer:
    """``starting`` says what the probe's start waits for, while it runs."""
    def details(latest: Snapshot | None) -> dict[str, Any]:
        probe = sampler.probe
        state, reason = probe.condition if isinstance(probe, ReportsCondition) else ("", "")
        if not state and (note := starting()):
            state, reason = "starting", note
        return {"target_pid": sampler.target_pid,
                "target_up": bool(latest and latest.target_up),
                **({"probe": {"state": state, "reason": reason}} if state else {})}

    health = sample_health(lambda: sampler.latest, sampler.interval_seconds, details)
    return start_metrics_server(_collector(sampler), health, options.listen, options.port,
                                version=lambda: sampler.latest,
                                web_config=options.web_config,
                                max_requests=options.max_requests)


def _linger(server: MetricsServer, grace: float, exited: str) -> None:
    """After the target's exit, serve dlprof_target_up 0 for ``grace`` seconds so that
    Prometheus's next scrape sees the end; but only if anything scraped at all."""
    if grace <= 0:
        log.info("%s", exited)
    elif server.scrapes == 0:
        log.info("%s; nothing has scraped /metrics, so the agent stops now", exited)
    else:
        log.info("%s; serving dlprof_target_up 0 for %g s more, so that the next scrape "
                 "sees it (Ctrl-C stops now; --grace sets how long)", exited, grace)
        time.sleep(grace)


def serve(pid: int, options: ServeOptions, *, out: TextIO = sys.stdout,
          before_stop: Callable[[int], None] | None = None,
          on_summary: Callable[[dict[str, Any]], None] | None = None,
          describe_exit: Callable[[], str] | None = None) -> int:
    """Attach to ``pid``, serve until the duration, Ctrl-C, SIGTERM or the target's
    exit, then print the summary. Returns the exit code.

    ``before_stop`` gets the port while the endpoint still serves, at the end;
    ``on_summary`` gets the summary as a dict (`Summary.as_dict`), even when quiet;
    ``describe_exit`` says how the target ended (`run`: with its exit code)."""
    target = open_target(pid)
    status = LiveStatus(out) if out.isatty() and not options.quiet else None
    if status is None and options.probe is not None and not options.quiet \
            and sys.stderr.isatty():
        status = LiveStatus(sys.stderr, notes_only=True)  # the probe's start, on its own
    configure_logging(status)
    try:
        sampler = make_sampler(pid, interval=options.interval, children=options.children,
                               gpu=options.gpu, probe=options.probe is not None,
                               max_series=options.max_series_per_target,
                               probe_deadline_seconds=options.channel.exchange_deadline(
                                   options.interval), node_name=options.node_name)
    except TargetNotFound:  # it ended between the check and the first read: a normal end
        log.info("process %d exited before the agent's first sample", pid)
        if not options.quiet:
            print(Summary().render(pid, target_exited=True), file=out)
        return ExitCode.FINISHED
    probe_start: ProbeStart | None = None
    server = _start_server(sampler, options, lambda: probe_start.note() if probe_start else "")
    summary = Summary()
    stop = threading.Event()
    try:
        # Served at once: a probe that already listens is taken now, one to inject is
        # reached meanwhile, and a job that ends at any moment from here on ends the
        # attach with the summary, as any end does.
        if options.probe is not None:
            probe_start = ProbeStart(target, options.probe, interval=options.interval,
                                     wait_seconds=options.probe_wait_seconds,
                                     timeouts=options.channel,
                                     on_open=lambda source: setattr(sampler, "probe", source))
            probe_start.open_running()
        first = sampler.sample_once()
        summary.add(first)
        reaching = probe_start is not None and not probe_start.done and first.target_up
        log.info("attached to pid %d (%s); serving http://%s:%d/metrics%s", pid,
                 first.target.name if first.target else "?", options.listen, server.port,
                 "; reaching for its probe in the background (step and layer metrics "
                 "start once it answers)" if reaching else "")
        if reaching and probe_start is not None:
            probe_start.start()

        def on_sample(snapshot: Snapshot) -> None:
            summary.add(snapshot)
            if status is not None:
                status.note = probe_start.note() if probe_start is not None else ""
                status.show(snapshot)

        failures: list[BaseException] = []

        def sample_until_stopped() -> None:
            # Not niced, unlike the render and serving threads: a niced reader of the
            # job's thread states runs mostly while the job's threads sleep, which
            # biases every instantaneous reading (runnable threads) low.
            try:
                sampler.run(stop, on_sample)
            except BaseException as error:  # a bug: re-raised below, with its traceback
                failures.append(error)

        loop = threading.Thread(target=sample_until_stopped, name="dlprof-sampler",
                                daemon=True)
        try:
            with sigterm_stops():
                loop.start()
                deadline = (None if options.duration is None
                            else time.monotonic() + options.duration)
                while loop.is_alive():
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        break
                    loop.join(0.2 if remaining is None else min(0.2, remaining))
                    if probe_start is not None:
                        if failure := probe_start.failure():
                            raise failure  # another agent holds the probe
                        if status is None:
                            probe_start.say_if_slow()
                stop.set()
                loop.join()
                if failures:
                    raise failures[0]
                exited = not sampler.latest or not sampler.latest.target_up
                if exited:
                    if status is not None:
                        status.clear()
                    _linger(server, options.grace,
                            describe_exit() if describe_exit else f"process {pid} exited")
        except (KeyboardInterrupt, StopRequested) as stopped:
            stop.set()
            if probe_start is not None:
                probe_start.quiet()  # its announcement, if any, before this line
            # A pass under way ends first: what it says (the probe's first answer,
            # say) comes before this line, which is the last.
            if loop.is_alive():
                loop.join(STOP_PASS_SECONDS)
            # A pass slower than that (a loaded host) may still report its news:
            # past the stop it is noise, and this line stays the last one.
            logging.getLogger("dlprof_agent").setLevel(logging.WARNING)
            print(f"dlprof-agent: stopped by "
                  f"{'SIGTERM' if isinstance(stopped, StopRequested) else 'Ctrl-C'}",
                  file=sys.stderr)
        if before_stop is not None:
            before_stop(server.port)
    finally:
        stop.set()
        sampler.close()
        if probe_start is not None:
            probe_start.abandon()
            if (source := probe_start.source) is not None:
                source.stop()  # the probe removes its hooks: the job is as it was
        server.stop()
    if status is not None:
        status.clear()
    if on_summary is not None:
        on_summary(summary.as_dict(pid))
    if not options.quiet:
        latest = sampler.latest
        print(summary.render(pid, target_exited=bool(latest and not latest.target_up)),
              file=out)
    return ExitCode.FINISHED


def snapshot_command(pid: int, *, children: bool, gpu: bool, out: TextIO) -> int:
    """One sample of ``pid``, printed in the text format that /metrics serves."""
    open_target(pid)
    configure_logging(None)
    sampler = make_sampler(pid, interval=DEFAULT_INTERVAL_SECONDS, children=children, gpu=gpu)
    _first_sample(sampler)
    out.write(render_text(_collector(sampler)).decode())
    out.flush()
    return ExitCode.FINISHED
