"""`dlprof-agent daemon`: one agent per node, for DaemonSets, systemd and SLURM.

It finds the jobs to watch by itself, every --scan-interval seconds:
- every process with a context on a GPU (NVML lists them);
- every process that loaded the in-process probe (its socket is in a runtime dir);
- every process whose command line matches a --match pattern.
--env NAME=VALUE keeps only processes whose environment holds that pair.

Each job is read as `attach` reads one (with its descendants, so that a data
loader's workers are not taken twice), except that a rank under a watched
launcher (RANK, SLURM_PROCID or TF_CONFIG in its environment) is a target of its
own, left out of the launcher's tree (docs/fleet-identity.md). The host and
the GPUs are read once per pass for all of them, and all of it is served on one
/metrics. A job that
exits is dropped in the same pass; for --grace seconds after, /metrics keeps its
`dlprof_target_up 0` and its probe's final totals (exit_totals.py), then its
series are gone.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import psutil

from dlprof_agent.agent.endpoint import start_metrics_server
from dlprof_agent.agent.exit_totals import (
    DEFAULT_GRACE_SECONDS,
    ExitedTargets,
    final_probe_totals,
)
from dlprof_agent.agent.loop import (
    StopRequested,
    run_on_deadlines,
    sample_health,
    sigterm_stops,
)
from dlprof_agent.agent.snapshot_builder import GpuReader, HostReader, SnapshotBuilder, error_log
from dlprof_agent.collectors.error_log import ErrorLog
from dlprof_agent.collectors.host import HostCollector
from dlprof_agent.collectors.identity import RANK_MARKERS, carries_rank
from dlprof_agent.collectors.limits import LimitsCollector
from dlprof_agent.collectors.process import ProcessCollector
from dlprof_agent.collectors.process_table import ProcessTable
from dlprof_agent.collectors.target import Target as JobProcess
from dlprof_agent.errors import ExitCode, ProbeAlreadyAttached, TargetAccessDenied, TargetGone
from dlprof_agent.exporters.admission import MAX_REQUESTS
from dlprof_agent.exporters.prometheus import NodeCollector
from dlprof_agent.exporters.web_config import WebConfig
from dlprof_agent.model.findings.tracker import FindingsTracker
from dlprof_agent.model.snapshot import NodeSnapshot, Snapshot
from dlprof_agent.probe.protocol import SOCKET_DIR_ENV
from dlprof_agent.probe_link.channel import (
    DEFAULT_TIMEOUTS,
    ChannelTimeouts,
    ProbeSource,
    open_probe,
)
from dlprof_agent.probe_link.client import find_probe_socket, probe_socket_pids
from dlprof_agent.probe_link.connect import ProbeOptions
from dlprof_agent.probe_link.exchanges import ReportsCondition
from dlprof_agent.probe_link.samples import ProbeSample
from dlprof_agent.probe_link.series_budget import (
    DEFAULT_AGENT_SERIES,
    DEFAULT_TARGET_SERIES,
    SeriesBudget,
)
from dlprof_agent.probe_link.start import STOP_INJECTION_WAIT_SECONDS

log = logging.getLogger("dlprof_agent")

# Where probes of any user put their sockets (probe.protocol.runtime_dir_candidates).
PROBE_SOCKET_DIRS = ("/tmp/dlprof-agent-*", "/run/user/*/dlprof-agent")


@dataclass(frozen=True)
class DaemonOptions:
    interval: float = 1.0
    scan_interval: float = 2.0
    matches: tuple[re.Pattern[str], ...] = ()
    environment: tuple[tuple[str, str], ...] = ()  # (name, value) every target must have
    probe: ProbeOptions | None = None  # None: never talk to the processes
    gpu: bool = True
    channel: ChannelTimeouts = DEFAULT_TIMEOUTS  # how long each probe's channel waits
    max_series_per_target: int = DEFAULT_TARGET_SERIES
    max_series: int = DEFAULT_AGENT_SERIES  # all targets together
    grace: float = DEFAULT_GRACE_SECONDS  # an exited job's final totals stay this long
    node_name: str = ""  # dlprof_target_info's node (--node-name, resolved)


def _same_rank(child: dict[str, str] | None, parent: dict[str, str] | None) -> bool:
    """Whether ``child`` has the rank of ``parent`` (a worker of that rank, which
    inherited its environment), rather than one of its own."""
    if parent is None or child is None or not carries_rank(parent):
        return False
    return all(child.get(name) == parent.get(name) for name in RANK_MARKERS)


class Discovery:
    """Which processes on this node are jobs to watch, and why."""

    def __init__(self, options: DaemonOptions, *,
                 socket_dirs: Iterable[str] = PROBE_SOCKET_DIRS) -> None:
        self._options = options
        own = os.environ.get(SOCKET_DIR_ENV)
        self._socket_dirs = (*socket_dirs, *((own,) if own else ()))
        # The daemon and the processes that started it (a shell, sudo, a prolog)
        # are never jobs, whatever --match says.
        self._excluded = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
        # Every process, kept between scans: a known one's command line and
        # environment are not read again.
        self.table = ProcessTable(matches=self._matches)

    def _matches(self, command: str) -> bool:
        return any(pattern.search(command) for pattern in self._options.matches)

    def candidates(self, gpu_pids: Iterable[int]) -> dict[int, str]:
        """pid -> why it is a job: "gpu", "probe" or "match"."""
        self.table.refresh()
        found = dict.fromkeys(gpu_pids, "gpu")
        for pid in probe_socket_pids(self._socket_dirs):
            # A socket's name carries the pid its process sees; in a container that
            # is another process's pid here. Only a pid whose own runtime dir holds
            # the socket is that job.
            if pid not in found and find_probe_socket(pid) is not None:
                found[pid] = "probe"
        if self._options.matches:
            for pid in self.table.matching():
                found.setdefault(pid, "match")
        return {pid: why for pid, why in found.items()
                if pid not in self._excluded and self._environment_matches(pid)}

    def _environment_matches(self, pid: int) -> bool:
        if not self._options.environment:
            return True
        environment = self.table.environ(pid)
        return environment is not None and all(
            environment.get(name) == value for name, value in self._options.environment)


@dataclass
class Target:
    pid: int
    reason: str
    processes: ProcessCollector
    probe: ProbeSource | None = None  # set by the connecting thread once ready
    limits: LimitsCollector | None = None
    findings: FindingsTracker = field(default_factory=FindingsTracker)
    dropped: bool = False
    probe_lock: threading.Lock = field(default_factory=threading.Lock)
    last: Snapshot | None = None  # the last pass's, kept through the grace once it exits
    last_probe: ProbeSample | None = None  # the probe's last totals (it closes before the exit)
    rank: bool = False  # its environment names its rank: its children are no ranks of their own

    def attach_probe(self, source: ProbeSource) -> None:
        with self.probe_lock:
            if not self.dropped:
                self.probe = source
                return
        source.stop()  # it ended while the probe was connecting

    def drop(self) -> None:
        with self.probe_lock:
            self.dropped = True
            probe, self.probe = self.probe, None
        if probe is not None:
            probe.stop()  # the probe removes its hooks: the job is as it was


class Daemon:
    """Finds targets and publishes one NodeSnapshot of them per pass (the pass
    itself is the SnapshotBuilder's)."""

    def __init__(self, options: DaemonOptions, *, discovery: Discovery,
                 host: HostReader, gpu: GpuReader | None, errors: ErrorLog,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.options = options
        self.targets: dict[int, Target] = {}
        self._discovery = discovery
        self._errors = errors
        self._clock = clock
        self.budget = SeriesBudget(per_target=options.max_series_per_target,
                                   total=options.max_series)
        self._builder = SnapshotBuilder(host=host, gpu=gpu, errors=errors, clock=clock,
                                        wall_clock=wall_clock, budget=self.budget,
                                        probe_deadline_seconds=options.channel.exchange_deadline(
                                            options.interval),
                                        node_name=options.node_name)
        self._next_scan = float("-inf")
        self._gpu_pids: frozenset[int] = frozenset()
        self._latest: NodeSnapshot | None = None
        self.exited = ExitedTargets(options.grace)
        self._connecting: list[threading.Thread] = []  # reaching probes, off the loop

    @property
    def latest(self) -> NodeSnapshot | None:
        return self._latest

    # -- finding targets ---------------------------------------------------------

    def scan(self) -> None:
        candidates = self._discovery.candidates(self._gpu_pids)
        for pid, reason in sorted(candidates.items()):
            if pid not in self.targets and not self._covered(pid):
                self._add(pid, reason)
        for pid in self._ranks_under_targets():
            if not self._covered(pid):
                self._add(pid, "rank")

    def _covered(self, pid: int) -> bool:
        """A descendant of a target is read with it already, unless it is a rank
        of its own (its environment carries RANK, SLURM_PROCID or TF_CONFIG) and
        that target is not: a launcher's ranks are targets, each with its probe.
        A rank's own children (data-loader workers) inherit its environment and
        stay with it."""
        table = self._discovery.table
        if pid not in table.entries:
            return True  # gone already
        parents = [parent for parent in table.ancestors(pid) if parent in self.targets]
        if not parents:
            return False
        environment = table.environ(pid)
        if not carries_rank(environment):
            return True
        return any(_same_rank(environment, table.environ(parent)) for parent in parents)

    def _ranks_under_targets(self) -> list[int]:
        """The ranks (by their environment) under targets that are no rank
        themselves: a launcher's (torchrun's, srun's) children, found whether or not
        they use a GPU yet or match --match."""
        ranks = []
        table = self._discovery.table
        for target in list(self.targets.values()):
            if target.rank:
                continue
            for child in table.children(target.pid):
                if child not in self.targets and carries_rank(table.environ(child)):
                    ranks.append(child)
        return ranks

    def _add(self, pid: int, reason: str) -> None:
        try:
            processes = ProcessCollector(JobProcess.of(pid), children=True, errors=self._errors,
                                         table=self._discovery.table)
        except (TargetGone, TargetAccessDenied):
            return  # gone, or not ours to read
        target = Target(pid, reason, processes, limits=LimitsCollector(processes.target),
                        rank=carries_rank(self._discovery.table.environ(pid)))
        self.targets[pid] = target
        self.exited.forget(pid)
        log.info("watching pid %d (%s; %s)", pid, _name(pid), {
            "gpu": "it uses a GPU", "probe": "it loaded the probe",
            "match": "its command line matches",
            "rank": "a rank under a watched launcher"}[reason])
        if self.options.probe is not None:
            connecting = threading.Thread(target=self._connect,
                                          args=(target, self.options.probe),
                                          name=f"dlprof-probe-{pid}", daemon=True)
            self._connecting = [t for t in self._connecting if t.is_alive()] + [connecting]
            connecting.start()

    def _connect(self, target: Target, options: ProbeOptions) -> None:
        """Off the sampling loop: an injection can take seconds."""
        if target.reason == "probe":
            options = replace(options, inject=False)  # it has one: never inject another
        try:
            source = open_probe(target.processes.target, options, interval=self.options.interval,
                                timeouts=self.options.channel)
        except ProbeAlreadyAttached as error:
            log.warning("no in-process metrics for pid %d: %s", target.pid, error.one_line())
            return
        except Exception as error:  # the job's process metrics must go on regardless
            self._errors.record("probe", error)
            return
        target.attach_probe(source)  # connected, or waiting: later passes keep trying

    def _drop(self, target: Target, why: str) -> None:
        del self.targets[target.pid]
        target.drop()
        log.info("stopped watching pid %d: %s", target.pid, why)

    # -- sampling ----------------------------------------------------------------

    def sample_once(self) -> NodeSnapshot:
        started = self._builder.start()
        if started.monotonic_seconds >= self._next_scan:
            self._next_scan = started.monotonic_seconds + self.options.scan_interval
            self.scan()
        for target in self.targets.values():  # a launcher's ranks are read on their own
            target.processes.set_excluded(frozenset(self.targets) - {target.pid})
        node = self._builder.build(list(self.targets.values()), started=started)
        sampled = {snapshot.target_pid: snapshot for snapshot in node.targets}
        for target in list(self.targets.values()):
            own = sampled.get(target.pid)
            if own is None:
                self._keep_final_totals(target, started.monotonic_seconds)
                self._drop(target, "it exited")
            else:
                target.last_probe = own.probe or target.last_probe
                target.last = own
        exited = self.exited.snapshots(timestamp_seconds=started.wall_seconds,
                                       monotonic_seconds=started.monotonic_seconds)
        if exited:
            node = replace(node, targets=node.targets + exited)
        if node.gpu is not None:
            self._gpu_pids = node.gpu.resident_pids
        self._latest = node
        return node

    def _keep_final_totals(self, target: Target, now: float) -> None:
        """``target`` has gone: keep its last pass, with its probe's final totals (the
        reply to the last read, if unread yet, else the last one read), for the grace."""
        if target.last is not None:
            final = final_probe_totals(target.probe, target.last_probe, self._errors)
            self.exited.keep(replace(target.last, probe=final), now)

    def run(self, stop: threading.Event) -> None:
        """Sample every interval until ``stop`` is set, on fixed deadlines."""

        def one_pass() -> bool:
            self.sample_once()
            return True

        run_on_deadlines(stop, self.options.interval, one_pass, self._clock)

    def probe_report(self) -> dict[str, dict[str, str]]:
        """For the status page: the targets whose probe figures are stale or
        missing, each with the reason (pid as text, as JSON keys are)."""
        latest = self._latest
        stale_in_pass = {snapshot.target_pid for snapshot in latest.targets
                         if snapshot.probe_stale} if latest is not None else set()
        report: dict[str, dict[str, str]] = {"stale": {}, "dropped": {}}
        for pid, target in sorted(self.targets.items()):
            source = target.probe
            state, reason = (source.condition if isinstance(source, ReportsCondition)
                             else ("", ""))
            if state in report:
                report[state][str(pid)] = reason
            elif pid in stale_in_pass:
                report["stale"][str(pid)] = "no whole reply within the pass's deadline"
        return report

    def close(self) -> None:
        self._builder.close()
        for target in list(self.targets.values()):
            self._drop(target, "the daemon is stopping")
        # A probe being reached (or injected) now is stopped as it comes up (the
        # target is dropped): give those a moment, within the time a stop may take.
        deadline = time.monotonic() + STOP_INJECTION_WAIT_SECONDS
        for connecting in self._connecting:
            connecting.join(max(0.0, deadline - time.monotonic()))


def _name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return "?"


def make_daemon(options: DaemonOptions) -> Daemon:
    from dlprof_agent.collectors.gpu import GpuCollector

    errors = error_log(gpu=options.gpu, probe=options.probe is not None)
    return Daemon(options, discovery=Discovery(options), host=HostCollector(),
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
        print("dlprof-agent: stopped by "
              f"{'SIGTERM' if isinstance(stopped, StopRequested) else 'Ctrl-C'}",
              file=sys.stderr)
    finally:
        daemon.close()
        server.stop()
    return ExitCode.FINISHED
