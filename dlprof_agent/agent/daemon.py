"""`dlprof-agent daemon`: one agent per node, for DaemonSets, systemd and SLURM.

It finds the jobs to watch by itself, every --scan-interval seconds:
- every process with a context on a GPU (NVML lists them);
- every process that loaded the in-process probe (its socket is in a runtime dir);
- every process whose command line matches a --match pattern.
--env NAME=VALUE keeps only processes whose environment holds that pair.

Each job is read as `attach` reads one (with its descendants, so a launcher's
ranks that are its children are not taken twice), the host and the GPUs once
per pass for all of them, and all of it is served on one /metrics. A job that
exits is dropped in the same pass; for --grace seconds after, /metrics keeps its
`dlprof_target_up 0` and its probe's final totals (exit_totals.py), then its
series are gone.
"""

from __future__ import annotations

import logging
import os
import re
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
from dlprof_agent.agent.findings.tracker import FindingsTracker
from dlprof_agent.agent.findings.window import point_of
from dlprof_agent.agent.loop import (
    StopRequested,
    guarded,
    run_on_deadlines,
    sample_health,
    sigterm_stops,
)
from dlprof_agent.agent.reach.channel import ProbeSource, open_probe
from dlprof_agent.agent.reach.connect import ProbeOptions
from dlprof_agent.agent.sampler import GpuReader
from dlprof_agent.collectors.error_log import ErrorLog
from dlprof_agent.collectors.gpu_samples import GpuSample
from dlprof_agent.collectors.host import HostCollector
from dlprof_agent.collectors.limits import LimitsCollector
from dlprof_agent.collectors.probe import find_probe_socket, probe_socket_pids
from dlprof_agent.collectors.probe_samples import ProbeSample
from dlprof_agent.collectors.process import ProcessCollector, ProcessSample
from dlprof_agent.errors import ExitCode, ProbeAlreadyAttached, TargetAccessDenied, TargetGone
from dlprof_agent.exporters.prometheus import NodeCollector
from dlprof_agent.exporters.web_config import WebConfig
from dlprof_agent.model.snapshot import AgentSelfSample, NodeSnapshot, Snapshot
from dlprof_agent.probe.protocol import SOCKET_DIR_ENV

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
    grace: float = DEFAULT_GRACE_SECONDS  # an exited job's final totals stay this long


def _read_environment(pid: int, procfs: str = "/proc") -> dict[str, str] | None:
    """None when it cannot be read: another user's process without root, or gone."""
    try:
        with open(f"{procfs}/{pid}/environ", "rb") as file:
            raw = file.read()
    except OSError:
        return None
    environment = {}
    for entry in raw.split(b"\0"):
        name, _, value = entry.partition(b"=")
        environment[name.decode(errors="replace")] = value.decode(errors="replace")
    return environment


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

    def candidates(self, gpu_pids: Iterable[int]) -> dict[int, str]:
        """pid -> why it is a job: "gpu", "probe" or "match"."""
        found = dict.fromkeys(gpu_pids, "gpu")
        for pid in probe_socket_pids(self._socket_dirs):
            # A socket's name carries the pid its process sees; in a container that
            # is another process's pid here. Only a pid whose own runtime dir holds
            # the socket is that job.
            if pid not in found and find_probe_socket(pid) is not None:
                found[pid] = "probe"
        if self._options.matches:
            for process in psutil.process_iter(["pid", "cmdline"]):
                command = " ".join(process.info["cmdline"] or ())
                if command and any(p.search(command) for p in self._options.matches):
                    found.setdefault(process.info["pid"], "match")
        return {pid: why for pid, why in found.items()
                if pid not in self._excluded and self._environment_matches(pid)}

    def _environment_matches(self, pid: int) -> bool:
        if not self._options.environment:
            return True
        environment = _read_environment(pid)
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
    """Finds targets, samples them, and publishes one NodeSnapshot per pass."""

    def __init__(self, options: DaemonOptions, *, discovery: Discovery,
                 host: HostCollector, gpu: GpuReader | None, errors: ErrorLog,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self.targets: dict[int, Target] = {}
        self._discovery = discovery
        self._host = host
        self._gpu = gpu
        self._errors = errors
        self._clock = clock
        self._next_scan = float("-inf")
        self._gpu_pids: frozenset[int] = frozenset()
        self._samples_total = 0
        self._latest: NodeSnapshot | None = None
        self.exited = ExitedTargets(options.grace)

    @property
    def latest(self) -> NodeSnapshot | None:
        return self._latest

    # -- finding targets ---------------------------------------------------------

    def scan(self) -> None:
        candidates = self._discovery.candidates(self._gpu_pids)
        for pid, reason in sorted(candidates.items()):
            if pid not in self.targets and not self._covered(pid):
                self._add(pid, reason)

    def _covered(self, pid: int) -> bool:
        """A descendant of a target is read with it already."""
        try:
            return any(parent.pid in self.targets for parent in psutil.Process(pid).parents())
        except psutil.Error:
            return True  # gone already

    def _add(self, pid: int, reason: str) -> None:
        try:
            processes = ProcessCollector(pid, children=True, errors=self._errors)
        except (TargetGone, TargetAccessDenied):
            return  # gone, or not ours to read
        target = Target(pid, reason, processes, limits=LimitsCollector(pid))
        self.targets[pid] = target
        self.exited.forget(pid)
        log.info("watching pid %d (%s; %s)", pid, _name(pid), {
            "gpu": "it uses a GPU", "probe": "it loaded the probe",
            "match": "its command line matches"}[reason])
        if self.options.probe is not None:
            threading.Thread(target=self._connect, args=(target, self.options.probe),
                             name=f"dlprof-probe-{pid}", daemon=True).start()

    def _connect(self, target: Target, options: ProbeOptions) -> None:
        """Off the sampling loop: an injection can take seconds."""
        if target.reason == "probe":
            options = replace(options, inject=False)  # it has one: never inject another
        try:
            source = open_probe(target.pid, options, interval=self.options.interval)
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
        started_wall, started = time.time(), self._clock()
        if started >= self._next_scan:
            self._next_scan = started + self.options.scan_interval
            self.scan()
        host = guarded(self._errors, "host", self._host.sample)
        read: list[tuple[Target, tuple[ProcessSample, ...]]] = []
        for target in list(self.targets.values()):
            try:
                read.append((target, target.processes.sample()))
            except TargetGone:
                self._keep_final_totals(target, started)
                self._drop(target, "it exited")
            except Exception as error:
                self._errors.record("process", error)
                read.append((target, ()))
        gpu = self._sample_gpu(frozenset(p.pid for _, samples in read for p in samples))
        agent = AgentSelfSample.read()
        snapshots = []
        for target, processes in read:
            probe_source = target.probe
            probe = (guarded(self._errors, "probe", probe_source.sample) if probe_source
                     else None)
            limits_source = target.limits
            limits = (guarded(self._errors, "process", limits_source.sample) if limits_source
                      else None)
            snapshot = Snapshot(
                timestamp_seconds=started_wall, monotonic_seconds=started,
                target_pid=target.pid, target_up=True, processes=processes,
                probe=probe, probe_up=probe is not None, limits=limits, agent=agent)
            findings = target.findings.update(point_of(snapshot, host=host, gpu=gpu))
            target.last_probe = probe or target.last_probe
            target.last = replace(snapshot, findings=findings)
            snapshots.append(target.last)
        snapshots.extend(self.exited.snapshots(timestamp_seconds=started_wall,
                                               monotonic_seconds=started))
        self._samples_total += 1
        node = NodeSnapshot(
            timestamp_seconds=started_wall, monotonic_seconds=started, host=host, gpu=gpu,
            targets=tuple(snapshots),
            collector_errors=tuple(sorted(self._errors.counts().items())),
            sample_duration_seconds=self._clock() - started,
            samples_total=self._samples_total, agent=agent)
        self._latest = node
        return node

    def _keep_final_totals(self, target: Target, now: float) -> None:
        """``target`` has gone: keep its last pass, with its probe's final totals (the
        reply to the last read, if unread yet, else the last one read), for the grace."""
        if target.last is not None:
            final = final_probe_totals(target.probe, target.last_probe, self._errors)
            self.exited.keep(replace(target.last, probe=final), now)

    def _sample_gpu(self, pids: frozenset[int]) -> GpuSample | None:
        gpu_source = self._gpu
        if gpu_source is None:
            return None
        gpu = guarded(self._errors, "gpu", lambda: gpu_source.sample(pids))
        if gpu is not None:
            self._gpu_pids = gpu.resident_pids
        return gpu

    def run(self, stop: threading.Event) -> None:
        """Sample every interval until ``stop`` is set, on fixed deadlines."""

        def one_pass() -> bool:
            self.sample_once()
            return True

        run_on_deadlines(stop, self.options.interval, one_pass, self._clock)

    def close(self) -> None:
        for target in list(self.targets.values()):
            self._drop(target, "the daemon is stopping")


def _name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return "?"


def make_daemon(options: DaemonOptions) -> Daemon:
    from dlprof_agent.collectors.gpu import GpuCollector

    errors = ErrorLog(("process", "host", "probe", *(("gpu",) if options.gpu else ())))
    return Daemon(options, discovery=Discovery(options), host=HostCollector(),
                  gpu=GpuCollector(errors=errors) if options.gpu else None, errors=errors)


def serve_node(options: DaemonOptions, listen: str, port: int,
               web_config: WebConfig | None = None) -> int:
    """Run the daemon, serving /metrics on ``listen``:``port``, until SIGTERM or Ctrl-C."""
    daemon = make_daemon(options)
    health = sample_health(lambda: daemon.latest, options.interval,
                           lambda latest: {"targets": sorted(daemon.targets)})
    server = start_metrics_server(
        NodeCollector(lambda: daemon.latest, interval_seconds=options.interval), health,
        listen, port, version=lambda: daemon.latest, web_config=web_config)
    stop = threading.Event()
    try:
        with sigterm_stops():
            log.info("daemon serving http://%s:%d/metrics; looking for jobs every %g s",
                     listen, server.port, options.scan_interval)
            daemon.run(stop)
    except (KeyboardInterrupt, StopRequested):
        stop.set()
    finally:
        daemon.close()
        server.stop()
    return ExitCode.FINISHED
