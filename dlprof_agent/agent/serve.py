"""`attach`: the agent's core (core.py) watching one target, with the front end of
one job: a live status line, the probe's start said as it goes, an end at the
duration, Ctrl-C, SIGTERM or the target's exit, and a summary; and `snapshot`,
the same core read once."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from dlprof_agent.agent.core import Agent, AgentOptions, OneTarget, TargetWatch, probe_condition
from dlprof_agent.agent.endpoint import DEFAULT_LISTEN, DEFAULT_PORT, start_metrics_server
from dlprof_agent.agent.loop import StopRequested, sample_health, sigterm_stops
from dlprof_agent.agent.snapshot_builder import error_log, target_snapshot
from dlprof_agent.agent.status import LiveStatus, Summary, configure_logging
from dlprof_agent.collectors.gpu import GpuCollector
from dlprof_agent.collectors.host import HostCollector
from dlprof_agent.collectors.target import Target, open_target
from dlprof_agent.errors import DlprofError, ExitCode, TargetNotFound
from dlprof_agent.exporters.admission import MAX_REQUESTS
from dlprof_agent.exporters.http import MetricsServer
from dlprof_agent.exporters.prometheus import NodeCollector
from dlprof_agent.exporters.text import render_text
from dlprof_agent.exporters.web_config import WebConfig
from dlprof_agent.model.snapshot import NodeSnapshot, Snapshot

if TYPE_CHECKING:  # Rich is imported by `top` alone: attach and the daemon stay lighter
    from dlprof_agent.agent.top_screen import TopScreen

MIN_INTERVAL_SECONDS = 0.05
STOP_PASS_SECONDS = 2.0  # how long a stop waits for the pass under way to end

log = logging.getLogger("dlprof_agent")


@dataclass(frozen=True)
class ServeOptions(AgentOptions):
    """The core's options, and how one job's agent serves and ends."""

    probe_first: bool = True  # the first sample holds a running probe's figures
    listen: str = DEFAULT_LISTEN
    port: int = DEFAULT_PORT
    duration: float | None = None
    quiet: bool = False
    web_config: WebConfig | None = None  # --web.config.file, loaded
    max_requests: int = MAX_REQUESTS  # --web.max-requests
    serve_metrics: bool = True  # False: `top --no-serve`, the screen alone


def make_agent(target: Target, options: AgentOptions,
               on_probe_failure: Callable[[TargetWatch, DlprofError], None] | None = None
               ) -> Agent:
    """The core watching ``target`` alone (with its descendants, unless not
    ``children``)."""
    errors = error_log(gpu=options.gpu, probe=options.probe is not None)
    return Agent(options, chooser=OneTarget(target, children=options.children),
                 host=HostCollector(), gpu=GpuCollector(errors=errors) if options.gpu else None,
                 errors=errors, on_probe_failure=on_probe_failure)


class _Attached:
    """The one target's part of each pass, as the status line and summary read it."""

    def __init__(self, agent: Agent, pid: int) -> None:
        self.agent = agent
        self.pid = pid

    @property
    def watch(self) -> TargetWatch | None:
        return self.agent.targets.get(self.pid)

    @property
    def latest(self) -> Snapshot | None:
        node = self.agent.latest
        return None if node is None else target_snapshot(node, self.pid)

    def note(self) -> str:
        """What the probe's start waits for, while it runs."""
        watch = self.watch
        return watch.start.note() if watch is not None and watch.start is not None else ""


def _start_server(attached: _Attached, options: ServeOptions) -> MetricsServer:
    agent = attached.agent

    def details(latest: NodeSnapshot | None) -> dict[str, Any]:
        watch = attached.watch
        state, reason = probe_condition(watch.probe if watch is not None else None)
        if not state and (note := attached.note()):
            state, reason = "starting", note
        own = None if latest is None else target_snapshot(latest, attached.pid)
        return {"target_pid": attached.pid,
                "target_up": bool(own and own.target_up),
                **({"probe": {"state": state, "reason": reason}} if state else {})}

    health = sample_health(lambda: agent.latest, options.interval, details)
    return start_metrics_server(
        NodeCollector(lambda: agent.latest, interval_seconds=options.interval), health,
        options.listen, options.port, version=lambda: agent.latest,
        web_config=options.web_config, max_requests=options.max_requests)


def _linger(server: MetricsServer | None, grace: float, exited: str) -> None:
    """After the target's exit, serve dlprof_target_up 0 for ``grace`` seconds so that
    Prometheus's next scrape sees the end; but only if anything scraped at all."""
    if grace <= 0 or server is None:
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
          describe_exit: Callable[[], str] | None = None,
          screen: Callable[[Agent], TopScreen] | None = None) -> int:
    """Attach to ``pid``, serve until the duration, Ctrl-C, SIGTERM or the target's
    exit, then print the summary. Returns the exit code.

    ``before_stop`` gets the port while the endpoint still serves, at the end;
    ``on_summary`` gets the summary as a dict (`Summary.as_dict`), even when quiet;
    ``describe_exit`` says how the target ended (`run`: with its exit code);
    ``screen`` makes `top`'s full screen, which then stands for the status line."""
    target = open_target(pid)
    status: LiveStatus | TopScreen | None = None
    top: TopScreen | None = None
    if out.isatty() and not options.quiet and screen is None:
        status = LiveStatus(out)
    if status is None and options.probe is not None and not options.quiet \
            and sys.stderr.isatty() and screen is None:
        status = LiveStatus(sys.stderr, notes_only=True)  # the probe's start, on its own
    configure_logging(status if isinstance(status, LiveStatus) else None)
    failures: list[BaseException] = []  # another agent holds the probe; a bug
    agent = make_agent(target, options,
                       on_probe_failure=lambda watch, error: failures.append(error))
    attached = _Attached(agent, pid)
    if screen is not None:
        status = top = screen(agent)
    server = _start_server(attached, options) if options.serve_metrics else None
    summary = Summary()
    stop = threading.Event()
    try:
        # Served at once: a probe that already listens is taken in the first pass,
        # one to inject is reached meanwhile, and a job that ends at any moment
        # from here on ends the attach with the summary, as any end does.
        agent.sample_once()
        first = attached.latest
        if first is None or not first.target_up:
            log.info("process %d exited before the agent's first sample", pid)
        else:
            summary.add(first)
            if top is not None:
                top.show(first)
            watch = attached.watch
            reaching = watch is not None and watch.start is not None and not watch.start.done
            log.info("attached to pid %d (%s); %s%s", pid,
                     first.target.name if first.target else "?",
                     f"serving http://{options.listen}:{server.port}/metrics"
                     if server is not None else "not serving /metrics (--no-serve)",
                     "; reaching for its probe in the background (step and "
                     "layer metrics start once it answers)" if reaching else "")

        def on_pass(node: NodeSnapshot) -> bool:
            snapshot = target_snapshot(node, pid)
            summary.add(snapshot)
            if status is not None:
                status.note = attached.note()
                status.show(snapshot)
            return snapshot.target_up

        def sample_until_stopped() -> None:
            # Not niced, unlike the render and serving threads: a niced reader of the
            # job's thread states runs mostly while the job's threads sleep, which
            # biases every instantaneous reading (runnable threads) low.
            try:
                agent.run(stop, on_pass)
            except BaseException as error:  # a bug: re-raised below, with its traceback
                failures.append(error)

        loop = threading.Thread(target=sample_until_stopped, name="dlprof-sampler",
                                daemon=True)
        try:
            with sigterm_stops():
                if first is not None and first.target_up:
                    loop.start()
                deadline = (None if options.duration is None
                            else time.monotonic() + options.duration)
                while loop.is_alive():
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        break
                    loop.join(0.2 if remaining is None else min(0.2, remaining))
                    if failures or (top is not None and top.quit.is_set()):
                        break
                    if status is None and (watch := attached.watch) is not None \
                            and watch.start is not None:
                        watch.start.say_if_slow()
                stop.set()
                loop.join()
                if failures:
                    raise failures[0]
                latest = attached.latest
                if not latest or not latest.target_up:
                    if status is not None:
                        status.clear()
                    _linger(server, options.grace,
                            describe_exit() if describe_exit else f"process {pid} exited")
        except (KeyboardInterrupt, StopRequested) as stopped:
            stop.set()
            if top is not None:
                top.clear()
            agent.quiet()  # a probe's announcement, if any, before this line
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
        if before_stop is not None and server is not None:
            before_stop(server.port)
    finally:
        stop.set()
        if top is not None:
            top.clear()  # the terminal as it was before anything else is said
        agent.close()  # the probe removes its hooks: the job is as it was
        if server is not None:
            server.stop()
    if status is not None:
        status.clear()
    if on_summary is not None:
        on_summary(summary.as_dict(pid))
    if not options.quiet:
        latest = attached.latest
        print(summary.render(pid, target_exited=bool(latest and not latest.target_up)),
              file=out)
    return ExitCode.FINISHED


def snapshot_command(pid: int, *, children: bool, gpu: bool, out: TextIO) -> int:
    """One sample of ``pid``, printed in the text format that /metrics serves."""
    target = open_target(pid)
    configure_logging(None)
    agent = make_agent(target, AgentOptions(children=children, gpu=gpu))
    node = agent.sample_once()
    if not target_snapshot(node, pid).target_up:
        raise TargetNotFound(f"process {pid} exited while the agent was starting",
                             "attach to a running job")
    out.write(render_text(NodeCollector(lambda: node,
                                        interval_seconds=agent.options.interval)).decode())
    out.flush()
    return ExitCode.FINISHED
