"""The agent's one core, under both commands: `attach PID` is the core watching one
target (``OneTarget``), `daemon` is the same core with discovery
(``discovery.Discovery``).

Each pass finds targets (on its chooser's schedule), reads them all at once
(snapshot_builder: host and GPUs once, each target's processes, limits and
probe), and publishes one NodeSnapshot. Each new target's probe is reached or
injected off the loop (probe_link/start.py). A target that exits is dropped in
the pass that sees it, and for --grace seconds after /metrics keeps its
`dlprof_target_up 0` and its probe's final totals (exit_totals.py); the pass
that sees an exit always publishes it, whatever the grace.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

from dlprof_agent.agent.exit_totals import (
    DEFAULT_GRACE_SECONDS,
    ExitedTargets,
    final_probe_totals,
)
from dlprof_agent.agent.loop import run_on_deadlines
from dlprof_agent.agent.snapshot_builder import GpuReader, HostReader, SnapshotBuilder
from dlprof_agent.collectors.error_log import ErrorLog
from dlprof_agent.collectors.identity import carries_rank
from dlprof_agent.collectors.limits import LimitsCollector
from dlprof_agent.collectors.process import ProcessCollector
from dlprof_agent.collectors.process_table import ProcessTable
from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import DlprofError, TargetAccessDenied, TargetGone
from dlprof_agent.model.findings.tracker import FindingsTracker
from dlprof_agent.model.snapshot import NodeSnapshot, Snapshot
from dlprof_agent.probe_link.channel import DEFAULT_TIMEOUTS, ChannelTimeouts, ProbeSource
from dlprof_agent.probe_link.connect import ProbeOptions
from dlprof_agent.probe_link.exchanges import ReportsCondition
from dlprof_agent.probe_link.samples import ProbeSample
from dlprof_agent.probe_link.series_budget import DEFAULT_TARGET_SERIES, SeriesBudget
from dlprof_agent.probe_link.start import STOP_INJECTION_WAIT_SECONDS, ProbeStart

log = logging.getLogger("dlprof_agent")

DEFAULT_INTERVAL_SECONDS = 1.0

# Why a target is watched, as the log says it; None: the user named it.
REASONS = {"given": None, "gpu": "it uses a GPU", "probe": "it loaded the probe",
           "match": "its command line matches", "rank": "a rank under a watched launcher"}


@dataclass(frozen=True)
class AgentOptions:
    """What the core does with each target: the one set of defaults of both commands."""

    interval: float = DEFAULT_INTERVAL_SECONDS
    probe: ProbeOptions | None = None  # None: never talk to the processes
    gpu: bool = True
    channel: ChannelTimeouts = DEFAULT_TIMEOUTS  # how long each probe's channel waits
    max_series_per_target: int = DEFAULT_TARGET_SERIES
    max_series: int | None = None  # all targets together; None: the one target's
    grace: float = DEFAULT_GRACE_SECONDS  # an exited job's final totals stay this long
    node_name: str = ""  # dlprof_target_info's node (--node-name, resolved)
    children: bool = True  # a target's descendants are read with it
    probe_wait_seconds: float = 0.0  # `run`: the probe appears once Python has started
    # Take a probe that already listens within the pass that finds its target, so
    # that `attach`'s first sample holds its figures; the daemon reaches every probe
    # off its loop, where a stopped job cannot hold up a pass.
    probe_first: bool = False


@dataclass
class TargetWatch:
    """One watched target: its readers, and its probe once reached."""

    target: Target
    reason: str
    processes: ProcessCollector
    limits: LimitsCollector | None = None
    findings: FindingsTracker = field(default_factory=FindingsTracker)
    probe: ProbeSource | None = None  # set by its ProbeStart once the channel is open
    start: ProbeStart | None = None
    rank: bool = False  # its environment names its rank: its children are no ranks of their own
    last: Snapshot | None = None  # the last pass's, kept through the grace once it exits
    last_probe: ProbeSample | None = None  # the probe's last totals (it closes before the exit)
    dropped: bool = False
    probe_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def pid(self) -> int:
        return self.target.pid

    def attach_probe(self, source: ProbeSource) -> None:
        with self.probe_lock:
            if not self.dropped:
                self.probe = source
                return
        source.stop()  # it ended while the probe was connecting

    def drop(self, wait_seconds: float = 0.0) -> None:
        """No more reads; its probe removes its hooks, the job is as it was. An
        injection under way gets ``wait_seconds`` to end, so that its probe is
        stopped now; one that ends later is stopped as it comes up."""
        with self.probe_lock:
            self.dropped = True
            probe, self.probe = self.probe, None
        if self.start is not None:
            self.start.abandon(wait_seconds)
            probe = probe or self.start.source
        if probe is not None:
            probe.stop()


class Chooser(Protocol):
    """Which processes the core watches."""

    @property
    def children(self) -> bool:
        """Whether a target's descendants are read with it."""
        ...

    @property
    def table(self) -> ProcessTable | None:
        """Every process, kept between scans, where the chooser keeps one."""
        ...

    def due(self, now: float) -> bool:
        """Whether to look for targets in the pass starting at ``now``."""
        ...

    def choose(self, watched: Mapping[int, TargetWatch], gpu_pids: frozenset[int]
               ) -> Iterator[tuple[Target, str]]:
        """New targets with why each is one, one at a time: ``watched`` already
        holds those added before, so that their descendants are not taken again."""
        ...


class OneTarget:
    """`attach`: the process the user gave, and (with ``children``) its descendants."""

    def __init__(self, target: Target, *, children: bool = True) -> None:
        self.target = target
        self._children = children
        self._chosen = False

    @property
    def children(self) -> bool:
        return self._children

    @property
    def table(self) -> ProcessTable | None:
        return None

    def due(self, now: float) -> bool:
        return not self._chosen

    def choose(self, watched: Mapping[int, TargetWatch], gpu_pids: frozenset[int]
               ) -> Iterator[tuple[Target, str]]:
        self._chosen = True
        yield self.target, "given"


class Agent:
    """Chooses targets and publishes one NodeSnapshot of them per pass (the pass
    itself is the SnapshotBuilder's)."""

    def __init__(self, options: AgentOptions, *, chooser: Chooser,
                 host: HostReader, gpu: GpuReader | None, errors: ErrorLog,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 on_probe_failure: Callable[[TargetWatch, DlprofError], None] | None = None
                 ) -> None:
        self.options = options
        self.targets: dict[int, TargetWatch] = {}
        self.chooser = chooser
        self.errors = errors
        self._clock = clock
        self._on_probe_failure = on_probe_failure or _say_no_probe
        self.budget = SeriesBudget(per_target=options.max_series_per_target,
                                   total=options.max_series)
        self._builder = SnapshotBuilder(host=host, gpu=gpu, errors=errors, clock=clock,
                                        wall_clock=wall_clock, budget=self.budget,
                                        probe_deadline_seconds=options.channel.exchange_deadline(
                                            options.interval),
                                        node_name=options.node_name)
        self._gpu_pids: frozenset[int] = frozenset()
        self._latest: NodeSnapshot | None = None
        self.exited = ExitedTargets(options.grace)

    @property
    def latest(self) -> NodeSnapshot | None:
        return self._latest

    # -- choosing targets --------------------------------------------------------

    def scan(self) -> None:
        for target, reason in self.chooser.choose(self.targets, self._gpu_pids):
            if target.pid not in self.targets:
                self._add(target, reason)

    def _add(self, target: Target, reason: str) -> None:
        chooser, pid = self.chooser, target.pid
        try:
            processes = ProcessCollector(target, children=chooser.children,
                                         errors=self.errors, table=chooser.table)
        except (TargetGone, TargetAccessDenied):
            return  # gone, or not ours to read
        environment = chooser.table.environ(pid) if chooser.table is not None else None
        watch = TargetWatch(target, reason, processes, limits=LimitsCollector(target),
                            rank=carries_rank(environment))
        self.targets[pid] = watch
        self.exited.forget(pid)
        if (why := REASONS[reason]) is not None:
            log.info("watching pid %d (%s; %s)", pid, _name(pid, chooser.table), why)
        if self.options.probe is not None:
            self._start_probe(watch, self.options.probe)

    def _start_probe(self, watch: TargetWatch, options: ProbeOptions) -> None:
        if watch.reason == "probe":
            options = replace(options, inject=False)  # it has one: never inject another
        start = ProbeStart(watch.target, options, interval=self.options.interval,
                           wait_seconds=self.options.probe_wait_seconds,
                           timeouts=self.options.channel, on_open=watch.attach_probe,
                           on_error=lambda error: self.errors.record("probe", error))
        watch.start = start
        if self.options.probe_first:
            try:
                start.open_running()
            except DlprofError as error:
                self._on_probe_failure(watch, error)
                return
        if not start.done:
            start.start()  # one to inject, or any for the daemon: off the loop

    def _drop(self, watch: TargetWatch, why: str, wait_seconds: float = 0.0) -> None:
        del self.targets[watch.pid]
        watch.drop(wait_seconds)
        if REASONS[watch.reason] is not None:
            log.info("stopped watching pid %d: %s", watch.pid, why)

    # -- sampling ----------------------------------------------------------------

    def sample_once(self) -> NodeSnapshot:
        started = self._builder.start()
        if self.chooser.due(started.monotonic_seconds):
            self.scan()
        for watch in self.targets.values():  # a launcher's ranks are read on their own
            watch.processes.set_excluded(frozenset(self.targets) - {watch.pid})
        node = self._builder.build(list(self.targets.values()), started=started)
        sampled = {snapshot.target_pid: snapshot for snapshot in node.targets}
        for watch in list(self.targets.values()):
            own = sampled.get(watch.pid)
            if own is None:
                self._keep_final_totals(watch, started.monotonic_seconds)
                self._drop(watch, "it exited")
                continue
            watch.last_probe = own.probe or watch.last_probe
            watch.last = own
            if watch.start is not None and (failure := watch.start.failure()):
                self._on_probe_failure(watch, failure)
        exited = self.exited.snapshots(timestamp_seconds=started.wall_seconds,
                                       monotonic_seconds=started.monotonic_seconds)
        if exited:
            node = replace(node, targets=node.targets + exited)
        if node.gpu is not None:
            self._gpu_pids = node.gpu.resident_pids
        self._latest = node  # one reference swap: readers never see a half-built state
        return node

    def _keep_final_totals(self, watch: TargetWatch, now: float) -> None:
        """``watch`` has gone: keep its last pass, with its probe's final totals (the
        reply to the last read, if unread yet, else the last one read), for the grace."""
        if watch.last is not None:
            final = final_probe_totals(watch.probe, watch.last_probe, self.errors)
            self.exited.keep(replace(watch.last, probe=final), now)

    def run(self, stop: threading.Event,
            on_pass: Callable[[NodeSnapshot], bool] = lambda node: True) -> None:
        """Sample every interval, on fixed deadlines, until ``stop`` is set or
        ``on_pass`` returns False."""
        run_on_deadlines(stop, self.options.interval,
                         lambda: on_pass(self.sample_once()), self._clock)

    def probe_report(self) -> dict[str, dict[str, str]]:
        """For the status page: the targets whose probe figures are stale or
        missing, each with the reason (pid as text, as JSON keys are)."""
        latest = self._latest
        stale_in_pass = {snapshot.target_pid for snapshot in latest.targets
                         if snapshot.probe_stale} if latest is not None else set()
        report: dict[str, dict[str, str]] = {"stale": {}, "dropped": {}}
        for pid, watch in sorted(self.targets.items()):
            state, reason = probe_condition(watch.probe)
            if state in report:
                report[state][str(pid)] = reason
            elif pid in stale_in_pass:
                report["stale"][str(pid)] = "no whole reply within the pass's deadline"
        return report

    def quiet(self) -> None:
        """The agent is stopping: a probe that comes up from now on is not announced."""
        for watch in self.targets.values():
            if watch.start is not None:
                watch.start.quiet()

    def close(self) -> None:
        """No more reads; every probe removes its hooks. An injection under way
        gets a moment to end, within the time a stop may take."""
        self._builder.close()
        deadline = time.monotonic() + STOP_INJECTION_WAIT_SECONDS
        for watch in list(self.targets.values()):
            self._drop(watch, "the agent is stopping",
                       wait_seconds=max(0.0, deadline - time.monotonic()))


def probe_condition(source: object) -> tuple[str, str]:
    """A probe channel's state and why ("stale", "dropped", ...), ("", "") if fine."""
    return source.condition if isinstance(source, ReportsCondition) else ("", "")


def _say_no_probe(watch: TargetWatch, error: DlprofError) -> None:
    log.warning("no in-process metrics for pid %d: %s", watch.pid, error.one_line())


def _name(pid: int, table: ProcessTable | None) -> str:
    entry = table.entries.get(pid) if table is not None else None
    return entry.comm if entry is not None else "?"
