"""How `daemon` chooses its targets, every --scan-interval seconds:
- every process with a context on a GPU (NVML lists them);
- every process that loaded the in-process probe (its socket is in a runtime dir);
- every process whose command line matches a --match pattern.
--env NAME=VALUE keeps only processes whose environment holds that pair.

Each is read with its descendants, so that a data loader's workers are not taken
twice, except that a rank under a watched launcher (RANK, SLURM_PROCID or
TF_CONFIG in its environment) is a target of its own, left out of the
launcher's tree (docs/fleet-identity.md)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from dlprof_agent.agent.core import AgentOptions, TargetWatch
from dlprof_agent.collectors.identity import RANK_MARKERS, carries_rank
from dlprof_agent.collectors.process_table import ProcessTable
from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import TargetAccessDenied, TargetGone
from dlprof_agent.probe.protocol import SOCKET_DIR_ENV
from dlprof_agent.probe_link.client import find_probe_socket, probe_socket_pids
from dlprof_agent.probe_link.series_budget import DEFAULT_AGENT_SERIES

# Where probes of any user put their sockets (probe.protocol.runtime_dir_candidates).
PROBE_SOCKET_DIRS = ("/tmp/dlprof-agent-*", "/run/user/*/dlprof-agent")


@dataclass(frozen=True)
class DaemonOptions(AgentOptions):
    max_series: int | None = DEFAULT_AGENT_SERIES  # all targets together
    scan_interval: float = 2.0
    matches: tuple[re.Pattern[str], ...] = ()
    environment: tuple[tuple[str, str], ...] = ()  # (name, value) every target must have


def _target(pid: int) -> Target | None:
    """The Target of a pid just found; None if it has gone or is not ours to read."""
    try:
        return Target.of(pid)
    except (TargetGone, TargetAccessDenied):
        return None


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
        # Every process, kept between scans: a known one's command line and
        # environment are not read again.
        self._table = ProcessTable(matches=self._matches)
        self._next_scan = float("-inf")

    @property
    def children(self) -> bool:
        return True

    @property
    def table(self) -> ProcessTable:
        return self._table

    def _matches(self, command: str) -> bool:
        return any(pattern.search(command) for pattern in self._options.matches)

    def due(self, now: float) -> bool:
        if now < self._next_scan:
            return False
        self._next_scan = now + self._options.scan_interval
        return True

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
        # The daemon and the processes that started it (a shell, sudo, a prolog)
        # are never jobs, whatever --match says.
        excluded = {os.getpid(), *self.table.ancestors(os.getpid())}
        return {pid: why for pid, why in found.items()
                if pid not in excluded and self._environment_matches(pid)}

    def _environment_matches(self, pid: int) -> bool:
        if not self._options.environment:
            return True
        environment = self.table.environ(pid)
        return environment is not None and all(
            environment.get(name) == value for name, value in self._options.environment)

    def choose(self, watched: Mapping[int, TargetWatch], gpu_pids: frozenset[int]
               ) -> Iterator[tuple[Target, str]]:
        for pid, reason in sorted(self.candidates(gpu_pids).items()):
            if pid not in watched and not self._covered(pid, watched) \
                    and (target := _target(pid)) is not None:
                yield target, reason
        for pid in self._ranks_under(watched):
            if not self._covered(pid, watched) and (target := _target(pid)) is not None:
                yield target, "rank"

    def _covered(self, pid: int, watched: Mapping[int, TargetWatch]) -> bool:
        """A descendant of a target is read with it already, unless it is a rank
        of its own (its environment carries RANK, SLURM_PROCID or TF_CONFIG) and
        that target is not: a launcher's ranks are targets, each with its probe.
        A rank's own children (data-loader workers) inherit its environment and
        stay with it."""
        table = self.table
        if pid not in table.entries:
            return True  # gone already
        parents = [parent for parent in table.ancestors(pid) if parent in watched]
        if not parents:
            return False
        environment = table.environ(pid)
        if not carries_rank(environment):
            return True
        return any(_same_rank(environment, table.environ(parent)) for parent in parents)

    def _ranks_under(self, watched: Mapping[int, TargetWatch]) -> list[int]:
        """The ranks (by their environment) under targets that are no rank
        themselves: a launcher's (torchrun's, srun's) children, found whether or not
        they use a GPU yet or match --match."""
        ranks = []
        for watch in list(watched.values()):
            if watch.rank:
                continue
            for child in self.table.children(watch.pid):
                if child not in watched and carries_rank(self.table.environ(child)):
                    ranks.append(child)
        return ranks
