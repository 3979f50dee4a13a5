"""What /metrics keeps of a job that has exited, through the grace period: the
probe's last totals (steps, samples, step time, phases, layers, kernels) beside
`dlprof_target_up 0`, so that the last scrape sees every step the agent read.
Without them a counter leaves /metrics with the job, and the steps since the
previous scrape never reach Prometheus.

The probe gives the agent one more read at the job's exit (probe/server.py,
``close_at_exit``); the final values are that read, else the last one before.
The agent's core (core.py) keeps each exited job here for ``grace_seconds``, and
publishes it at least in the pass that saw the exit, so that `attach` ends on it
whatever the grace."""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from dlprof_agent.collectors.error_log import ErrorLog
from dlprof_agent.model.snapshot import Snapshot
from dlprof_agent.probe_link.samples import ProbeSample

DEFAULT_GRACE_SECONDS = 15.0  # one scrape at Prometheus's usual 15 s interval


class FinalRead(Protocol):
    """A probe's channel that can take the reply to its last read after the exit
    (probe_link/channel.py's ProbeSource)."""

    def final_sample(self) -> ProbeSample | None: ...


def final_probe_totals(source: FinalRead | None, last: ProbeSample | None,
                       errors: ErrorLog) -> ProbeSample | None:
    """The final totals of a probe whose target was just seen gone: its reply to
    the agent's last read if that is still unread, else ``last``, the last read."""
    if source is None:
        return last
    try:
        final = source.final_sample()
    except Exception as error:  # counted, as a failed read of any pass is
        errors.record("probe", error)
        return last
    return final or last


def exited_snapshot(last: Snapshot, *, timestamp_seconds: float,
                    monotonic_seconds: float) -> Snapshot:
    """``last`` (the job's last snapshot while it ran) once it has gone: down, with
    no processes, limits or findings, and its probe's last totals."""
    return replace(last, timestamp_seconds=timestamp_seconds,
                   monotonic_seconds=monotonic_seconds, target_up=False, processes=(),
                   probe_up=False, limits=None, findings=())


class ExitedTargets:
    """Jobs that exited less than ``grace_seconds`` ago, each as its last snapshot."""

    def __init__(self, grace_seconds: float = DEFAULT_GRACE_SECONDS) -> None:
        self.grace_seconds = grace_seconds
        self._exited: dict[int, tuple[float, Snapshot]] = {}  # pid -> (exit time, last)

    def keep(self, last: Snapshot | None, now: float) -> None:
        """``last`` is the snapshot of a job seen gone at ``now``; None: nothing to keep."""
        if last is not None:
            self._exited[last.target_pid] = (now, last)

    def forget(self, pid: int) -> None:
        """A new process has ``pid``: the exited one's series would collide with it."""
        self._exited.pop(pid, None)

    def snapshots(self, *, timestamp_seconds: float, monotonic_seconds: float
                  ) -> tuple[Snapshot, ...]:
        """The exited jobs still within the grace period, and those that exited in
        this pass; the older are let go."""
        self._exited = {pid: kept for pid, kept in self._exited.items()
                        if monotonic_seconds - kept[0] < self.grace_seconds
                        or kept[0] == monotonic_seconds}
        return tuple(exited_snapshot(last, timestamp_seconds=timestamp_seconds,
                                     monotonic_seconds=monotonic_seconds)
                     for _, last in sorted(self._exited.values(),
                                           key=lambda kept: kept[1].target_pid))

    def __len__(self) -> int:
        return len(self._exited)
