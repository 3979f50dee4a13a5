"""One sampling pass, the same for `attach` and `daemon`: a list of targets goes
in, one NodeSnapshot comes out.

The builder reads the host and the GPUs once, each target's process tree, limits
and probe, judges its findings, and times the pass on an injected clock. A
collector that fails is counted in the agent's one ErrorLog and its series are
left out of this pass; the others still publish. A target whose process has
exited is left out of the pass: the core (core.py) stops watching it and
publishes it down through the grace. How targets are chosen is the core's
chooser's business (one pid, or discovery)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol, TypeVar

from dlprof_agent.collectors.error_log import ErrorLog
from dlprof_agent.collectors.gpu_samples import GpuSample
from dlprof_agent.collectors.host import HostSample
from dlprof_agent.collectors.identity import (
    ROLE_LAUNCHER,
    ROLE_RANK,
    Identity,
    read_identity,
    with_probe,
)
from dlprof_agent.collectors.limits import LimitsSample
from dlprof_agent.collectors.process import ProcessSample
from dlprof_agent.collectors.procfs import PROC_ROOT, ProcessFiles
from dlprof_agent.errors import TargetGone
from dlprof_agent.model.findings.tracker import FindingsTracker
from dlprof_agent.model.findings.window import point_of
from dlprof_agent.model.snapshot import AgentSelfSample, NodeSnapshot, Snapshot
from dlprof_agent.probe_link.exchanges import Exchange, ProbeExchanges
from dlprof_agent.probe_link.samples import ProbeSample
from dlprof_agent.probe_link.series_budget import SeriesBudget, process_series

_T = TypeVar("_T")


class HostReader(Protocol):
    def sample(self) -> HostSample: ...


class GpuReader(Protocol):
    """What a pass needs from the GPU collector."""

    def sample(self, pids: frozenset[int]) -> GpuSample: ...


class ProcessReader(Protocol):
    """A target's process tree; raises TargetGone once the target has exited."""

    def sample(self) -> tuple[ProcessSample, ...]: ...


class LimitsReader(Protocol):
    def sample(self) -> LimitsSample: ...


class ProbeReader(Protocol):
    """What a pass needs from the in-process probe's channel."""

    @property
    def up(self) -> bool: ...

    def sample(self) -> ProbeSample | None: ...

    def final_sample(self) -> ProbeSample | None:
        """The reply to the last read, taken once the target has exited (exit_totals)."""
        ...


class Watched(Protocol):
    """A target as a pass reads it. `core.TargetWatch` is one; so is TargetReaders."""

    @property
    def pid(self) -> int: ...

    @property
    def processes(self) -> ProcessReader: ...

    @property
    def limits(self) -> LimitsReader | None: ...

    @property
    def probe(self) -> ProbeReader | None: ...

    @property
    def findings(self) -> FindingsTracker | None: ...


@dataclass(frozen=True)
class TargetReaders:
    """The readers of one target, for callers that keep no target record of their own."""

    pid: int
    processes: ProcessReader
    limits: LimitsReader | None = None
    probe: ProbeReader | None = None
    findings: FindingsTracker | None = None


class PassStart(NamedTuple):
    wall_seconds: float  # unix time
    monotonic_seconds: float


# How long a pass waits for the probes' replies when its caller does not say
# (ChannelTimeouts.exchange_deadline does, from the interval).
PROBE_DEADLINE_SECONDS = 2.0


def error_log(*, gpu: bool, probe: bool) -> ErrorLog:
    """The agent's one error counter, with every collector a pass runs at 0, so
    that a rate() over dlprof_collector_errors_total exists before any failure."""
    return ErrorLog(("process", "host", *(("gpu",) if gpu else ()),
                     *(("probe",) if probe else ()), "identity"))


class SnapshotBuilder:
    """Builds one NodeSnapshot per call from the targets it is given."""

    def __init__(self, *, host: HostReader, gpu: GpuReader | None, errors: ErrorLog,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 agent_self: Callable[[], AgentSelfSample] = AgentSelfSample.read,
                 budget: SeriesBudget | None = None,
                 probe_deadline_seconds: float = PROBE_DEADLINE_SECONDS,
                 node_name: str = "", procfs_root: str = PROC_ROOT) -> None:
        self.errors = errors
        # Every target's probe at once, all within one deadline per pass.
        self.exchanges = ProbeExchanges(
            deadline_seconds=probe_deadline_seconds,
            on_error=lambda pid, error: self._record("probe", error, pid))
        self.budget = budget  # folds the probes' rows past the series budgets
        self.clock = clock
        self._host = host
        self._gpu = gpu
        self._wall_clock = wall_clock
        self._agent_self = agent_self
        self.samples_total = 0
        self.node_name = node_name
        self._procfs_root = procfs_root
        # Each target's identity from its environment and cgroup, read once: the
        # environment is the one at exec, and a failure is counted once per target.
        self._identities: dict[int, Identity] = {}

    def start(self) -> PassStart:
        """When a pass starts; a caller that finds targets first passes it to build(),
        so that the pass's duration includes finding them."""
        return PassStart(self._wall_clock(), self.clock())

    def build(self, targets: Iterable[Watched], *, started: PassStart | None = None
              ) -> NodeSnapshot:
        started = started or self.start()
        read: list[tuple[Watched, tuple[ProcessSample, ...]]] = []
        for target in targets:
            try:
                read.append((target, target.processes.sample()))
            except TargetGone:
                continue  # left out of the pass
            except Exception as error:
                self._record("process", error, target.pid)
                read.append((target, ()))
        host = self._guarded("host", self._host.sample)
        gpu = self._sample_gpu(frozenset(p.pid for _, samples in read for p in samples))
        agent = self._agent_self()
        exchanges = self.exchanges.read([(target.pid, target.probe) for target, _ in read])
        probes = [exchange.sample for exchange in exchanges]
        if self.budget is not None:  # all targets at once: the daemon's budget is shared
            probes = self.budget.fold([(probe, process_series(processes))
                                       for probe, (_, processes) in zip(probes, read,
                                                                        strict=True)])
        identities = self._identities_of(read, probes)
        snapshots = tuple(
            replace(self._target_snapshot(target, processes, probe, started, agent=agent,
                                          node=(host, gpu), exchange=exchange),
                    identity=identity)
            for (target, processes), probe, exchange, identity in zip(
                read, probes, exchanges, identities, strict=True))
        self.samples_total += 1
        return NodeSnapshot(
            timestamp_seconds=started.wall_seconds,
            monotonic_seconds=started.monotonic_seconds, host=host, gpu=gpu,
            targets=snapshots, collector_errors=tuple(sorted(self.errors.counts().items())),
            sample_duration_seconds=self.clock() - started.monotonic_seconds,
            samples_total=self.samples_total, agent=agent,
            series_dropped=self.budget.dropped() if self.budget is not None else ())

    def close(self) -> None:
        """No more probe reads (the loop is ending)."""
        self.exchanges.close()

    def _target_snapshot(self, target: Watched, processes: tuple[ProcessSample, ...],
                         probe: ProbeSample | None, started: PassStart, *,
                         agent: AgentSelfSample,
                         node: tuple[HostSample | None, GpuSample | None],
                         exchange: Exchange) -> Snapshot:
        limits_reader = target.limits
        # Limits come from the same /proc tree as the processes: counted with them.
        limits = (None if limits_reader is None
                  else self._guarded("process", limits_reader.sample, target.pid))
        snapshot = Snapshot(
            timestamp_seconds=started.wall_seconds,
            monotonic_seconds=started.monotonic_seconds, target_pid=target.pid,
            target_up=True, processes=processes, probe=probe,
            probe_up=probe is not None,
            probe_stale=exchange.stale, probe_misses=exchange.misses, limits=limits, agent=agent)
        tracker = target.findings
        if tracker is None:
            return snapshot
        host, gpu = node  # the findings judge the target against the node it runs on
        return replace(snapshot, findings=tracker.update(point_of(snapshot, host=host, gpu=gpu)))

    def _identities_of(self, read: list[tuple[Watched, tuple[ProcessSample, ...]]],
                       probes: list[ProbeSample | None]) -> list[Identity]:
        """Each target's identity, the probe's rank over the environment's, and
        "launcher" for a target that is the parent of a rank that is a target."""
        known, self._identities = self._identities, {}
        identities = []
        for (target, _), probe in zip(read, probes, strict=True):
            identity = known.get(target.pid) or self._read_identity(target.pid)
            self._identities[target.pid] = identity
            identities.append(identity if probe is None else with_probe(identity,
                                                                         probe.settings))
        rank_parents = {process.ppid for (_, processes), identity in zip(
                            read, identities, strict=True)
                        if identity.role == ROLE_RANK
                        for process in processes if process.is_target}
        return [replace(identity, role=ROLE_LAUNCHER)
                if target.pid in rank_parents and identity.role != ROLE_RANK else identity
                for (target, _), identity in zip(read, identities, strict=True)]

    def _read_identity(self, pid: int) -> Identity:
        try:
            identity = read_identity(ProcessFiles(pid, root=self._procfs_root),
                                     node=self.node_name)
        except TargetGone:
            return Identity(node=self.node_name)  # it exits in this pass
        except Exception as error:  # one target's identity never stops the others
            self._record("identity", error, pid)
            return Identity(node=self.node_name)
        if identity.problems:
            self.errors.record("identity", f"pid {pid}: {'; '.join(identity.problems)}")
        return identity

    def _sample_gpu(self, pids: frozenset[int]) -> GpuSample | None:
        gpu_source = self._gpu
        if gpu_source is None:
            return None
        return self._guarded("gpu", lambda: gpu_source.sample(pids))

    def _guarded(self, collector: str, read: Callable[[], _T], pid: int | None = None
                 ) -> _T | None:
        """``read()``, or None with the failure counted. Exception only: a stop
        request (a BaseException) raised inside a read must still end the loop."""
        try:
            return read()
        except Exception as error:
            self._record(collector, error, pid)
            return None

    def _record(self, collector: str, error: Exception, pid: int | None) -> None:
        # The pid in the message: the same failure in two targets is logged for each.
        message = f"{type(error).__name__}: {error}"
        self.errors.record(collector, message if pid is None else f"pid {pid}: {message}")


def target_snapshot(node: NodeSnapshot, pid: int) -> Snapshot:
    """``pid``'s part of the pass with the node's host, GPUs and agent figures, as
    `attach` publishes it; target down when the pass left it out (it exited)."""
    own = next((s for s in node.targets if s.target_pid == pid), None)
    if own is None:
        own = Snapshot(timestamp_seconds=node.timestamp_seconds,
                       monotonic_seconds=node.monotonic_seconds, target_pid=pid,
                       target_up=False, agent=node.agent)
    return replace(own, host=node.host, gpu=node.gpu,
                   collector_errors=node.collector_errors,
                   sample_duration_seconds=node.sample_duration_seconds,
                   samples_total=node.samples_total, series_dropped=node.series_dropped)
