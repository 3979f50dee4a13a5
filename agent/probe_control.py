"""Gets the agent talking to the probe inside the target: an existing probe
(started by `run` or by the job itself) is used as is; otherwise one is
injected, unless the user said --no-inject. When none can be had, attach goes
on out of process and says once why the in-process metrics are missing."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from dlprof_agent.agent.errors import AgentError
from dlprof_agent.collectors.probe import (
    REPLY_SECONDS,
    ProbeBusy,
    ProbeClient,
    ProbeSample,
    ProbeUnavailable,
    ReplyLate,
    find_probe_socket,
)
from dlprof_agent.collectors.process import read_state

log = logging.getLogger("dlprof_agent")

SOCKET_WAIT_SECONDS = 10.0  # an injected bootstrap runs at the target's next safe point


class ProbeAlreadyAttached(AgentError):
    exit_code = 6


@dataclass(frozen=True)
class ProbeOptions:
    inject: bool = True
    layers: bool = False
    warmup_steps: int = 10
    wait_seconds: float = SOCKET_WAIT_SECONDS


def _start_options(options: ProbeOptions, interval: float) -> dict[str, object]:
    return {"interval_seconds": interval, "layers": options.layers,
            "warmup_steps": options.warmup_steps, "agent_pid": os.getpid()}


def _wait_for_socket(pid: int, seconds: float) -> str | None:
    deadline = time.monotonic() + seconds
    while True:
        path = find_probe_socket(pid)
        if path is not None or time.monotonic() >= deadline or not _running(pid):
            return path
        time.sleep(0.05)


def _connect(pid: int, path: str, options: ProbeOptions, interval: float) -> ProbeClient:
    try:
        return ProbeClient.connect(pid, path, _start_options(options, interval))
    except ProbeBusy as busy:
        raise ProbeAlreadyAttached(
            f"process {pid} already has an agent attached (pid {busy.agent_pid})",
            f"scrape that agent, or stop it first (kill {busy.agent_pid})") from None


def connect_probe(pid: int, options: ProbeOptions, *, interval: float,
                  wait_seconds: float = 0.0) -> ProbeClient | None:
    """A started probe client, or None with the reason logged once."""
    path = _wait_for_socket(pid, wait_seconds) if wait_seconds else find_probe_socket(pid)
    if path is not None:
        try:
            return _connect(pid, path, options, interval)
        except ProbeUnavailable as error:
            if not options.inject:
                _missing(pid, f"the probe in it is unreachable: {error}")
                return None
            # A stale socket of an earlier process with this pid: inject afresh.
    if not options.inject:
        _missing(pid, "it has no probe and --no-inject was given; start the job with "
                      "`dlprof-agent run -- ...` or call dlprof_agent.probe.enable() in it")
        return None
    from dlprof_agent.agent import inject
    from dlprof_agent.probe.bootstrap import injection_code

    try:
        inject.inject(pid, injection_code())
    except inject.InjectionError as error:
        _missing(pid, error.one_line())
        return None
    path = _wait_for_socket(pid, options.wait_seconds)
    if path is None:
        _missing(pid, f"the injected probe did not start within {options.wait_seconds:g} s "
                      "(the main thread may be stuck in native code, or the job's Python "
                      "is older than 3.10)")
        return None
    try:
        return _connect(pid, path, options, interval)
    except ProbeUnavailable as error:
        _missing(pid, f"the injected probe did not answer: {error}")
        return None


def _missing(pid: int, why: str) -> None:
    log.warning("no in-process metrics (steps, layers, framework settings) for pid %d: %s; "
                "the process, thread and GPU metrics are unaffected", pid, why)


def _running(pid: int) -> bool:
    return read_state(pid) not in (None, "Z", "X")


# A job that is exiting closes its probe, then may take seconds to tear down its
# framework (thread pools, allocators) before it is gone.
EXIT_GRACE_SECONDS = 5.0
# Imports and graph builds can hold the GIL, and so the probe's answer, for seconds.
LATE_LIMIT_SECONDS = 10.0


class ProbeSource:
    """The sampler's view of the probe: a sample per pass, or None once it is gone.

    It is on the sampling pass, so it never waits long: a reply gets half an interval
    (a stopped or stuck job must not hold up the process and GPU metrics). A reply
    that comes later is taken on a later pass; meanwhile the last sample stands. The
    probe is lost when its connection breaks or it has not answered for
    LATE_LIMIT_SECONDS, and that is reported on a later pass, once the job has had
    time to exit if it was exiting."""

    def __init__(self, client: ProbeClient, *, interval: float) -> None:
        self.client: ProbeClient | None = client
        self.pid = client.pid
        client.set_timeout(max(0.25, min(REPLY_SECONDS, interval / 2)))
        self._lost: tuple[float, str] | None = None  # when, and why
        self._late_since: float | None = None
        self._last: ProbeSample | None = None

    @property
    def up(self) -> bool:
        return self.client is not None

    def sample(self) -> ProbeSample | None:
        client = self.client
        if client is None:
            self._report_loss()
            return None
        now = time.monotonic()
        try:
            sample = client.snapshot()
        except ReplyLate:
            self._late_since = self._late_since or now
            if now - self._late_since < LATE_LIMIT_SECONDS:
                return self._last
            self._drop(client, f"no reply for {now - self._late_since:.0f} s")
            return None
        except Exception as error:  # a closed socket, a bad frame
            self._drop(client, str(error) or type(error).__name__)
            return None
        self._late_since, self._last = None, sample
        return sample

    def _drop(self, client: ProbeClient, why: str) -> None:
        self.client = None
        client.close()
        self._lost = (time.monotonic(), why)

    def _report_loss(self) -> None:
        if self._lost is None:
            return
        since, why = self._lost
        if not _running(self.pid):
            self._lost = None  # the job ended: nothing to report
        elif time.monotonic() - since >= EXIT_GRACE_SECONDS:
            self._lost = None
            log.warning("lost the probe in pid %d (%s); in-process metrics stop here",
                        self.pid, why)

    def stop(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.stop()
