"""Gets the agent talking to the probe inside the target: an existing probe
(started by `run` or by the job itself) is used as is; otherwise one is
injected, unless the user said --no-inject. When none can be had, attach goes
on out of process and says once why the in-process metrics are missing."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from dlprof_agent.agent.errors import AgentError, TraceUnavailable
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
_T = TypeVar("_T")

SOCKET_WAIT_SECONDS = 10.0  # an injected bootstrap runs at the target's next safe point


class ProbeAlreadyAttached(AgentError):
    exit_code = 6


@dataclass(frozen=True)
class ProbeOptions:
    inject: bool = True
    layers: bool = False
    warmup_steps: int = 10
    wait_seconds: float = SOCKET_WAIT_SECONDS
    kernels: bool = True  # continuous CUPTI kernel tracing while the job uses CUDA
    layers_budget: float = 0.01  # share of step time layer timing may add
    layers_every: int = 0  # > 0: time one step in this many, whatever the budget


def _start_options(options: ProbeOptions, interval: float) -> dict[str, object]:
    started: dict[str, object] = {"interval_seconds": interval, "layers": options.layers,
                                  "warmup_steps": options.warmup_steps,
                                  "agent_pid": os.getpid()}
    if not options.kernels:
        # Sent only when off: a probe older than kernel tracing refuses unknown options.
        started["kernels"] = False
    if options.layers and options.layers_budget != 0.01:
        started["layers_budget"] = options.layers_budget  # likewise: only when not default
    if options.layers and options.layers_every:
        started["layers_every"] = options.layers_every
    return started


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


class _NoProbe(Exception):
    """Why the process has no probe to talk to, in plain words."""


def _reach_probe(pid: int, options: ProbeOptions, wait_seconds: float,
                 connect: Callable[[str], _T]) -> _T:
    """``connect(socket path)`` to the probe of ``pid``, injecting one first where
    there is none and the options allow it. Raises _NoProbe."""
    path = _wait_for_socket(pid, wait_seconds) if wait_seconds else find_probe_socket(pid)
    if path is not None:
        try:
            return connect(path)
        except ProbeBusy:
            raise
        except ProbeUnavailable as error:
            if not options.inject:
                raise _NoProbe(f"the probe in it is unreachable: {error}") from None
            # A stale socket of an earlier process with this pid: inject afresh.
    if not options.inject:
        raise _NoProbe("it has no probe and --no-inject was given; start the job with "
                       "`dlprof-agent run -- ...` or call dlprof_agent.probe.enable() in it")
    from dlprof_agent.agent import inject
    from dlprof_agent.probe.bootstrap import injection_code

    try:
        inject.inject(pid, injection_code())
    except inject.InjectionError as error:
        raise _NoProbe(error.one_line()) from None
    path = _wait_for_socket(pid, options.wait_seconds)
    if path is None:
        raise _NoProbe(f"the injected probe did not start within {options.wait_seconds:g} s "
                       "(the main thread may be stuck in native code, or the job's Python "
                       "is older than 3.10)")
    try:
        return connect(path)
    except ProbeBusy:
        raise
    except ProbeUnavailable as error:
        raise _NoProbe(f"the injected probe did not answer: {error}") from None


def connect_probe(pid: int, options: ProbeOptions, *, interval: float,
                  wait_seconds: float = 0.0) -> ProbeClient | None:
    """A started probe client, or None with the reason logged once."""
    try:
        return _reach_probe(pid, options, wait_seconds,
                            lambda path: _connect(pid, path, options, interval))
    except _NoProbe as why:
        _missing(pid, str(why))
        return None


TRACE_INTERVAL_SECONDS = 1.0  # the trace client's own session: it polls well within the lease


def open_trace_channel(pid: int, options: ProbeOptions, trace_args: dict[str, object]
                       ) -> tuple[ProbeClient, dict[str, Any] | None]:
    """A connection to ask the probe of ``pid`` for a trace: our own session (the
    reply is None: say ``trace`` next), or, beside an attached agent, a second
    connection that said ``trace`` already (with the probe's reply)."""
    def connect(path: str) -> tuple[ProbeClient, dict[str, Any] | None]:
        try:
            return ProbeClient.connect(pid, path, _start_options(
                options, TRACE_INTERVAL_SECONDS)), None
        except ProbeBusy:
            return ProbeClient.connect_beside(pid, path, {"command": "trace",
                                                          "args": trace_args})
    try:
        return _reach_probe(pid, options, 0.0, connect)
    except ProbeBusy as busy:
        raise TraceUnavailable(
            f"process {pid} has an agent attached (pid {busy.agent_pid}) whose probe is "
            "too old to trace beside it", "restart the job with this dlprof-agent version"
        ) from None
    except _NoProbe as why:
        raise TraceUnavailable(f"no probe in process {pid}: {why}",
                               "kernel traces are taken by the in-process probe") from None


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
        self._kernel_state: tuple[str, str] | None = None

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
        self._report_kernel_state(sample)
        return sample

    def _report_kernel_state(self, sample: ProbeSample) -> None:
        """Say once per change what the kernel tracer does, and why not."""
        kernels = sample.kernels
        if kernels is None or (kernels.state, kernels.reason) == self._kernel_state:
            return
        self._kernel_state = (kernels.state, kernels.reason)
        log.info("kernel tracing in pid %d: %s%s", self.pid, kernels.state,
                 f" ({kernels.reason})" if kernels.reason else "")

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
