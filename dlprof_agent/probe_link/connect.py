"""Gets the agent talking to the probe inside the target: an existing probe
(started by `run` or by the job itself) is used as is; otherwise one is
injected, unless the user said --no-inject. When none can be had, attach goes
on out of process and says once why the in-process metrics are missing;
``channel.ProbeSource`` keeps trying on later passes."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import (
    InjectionError,
    InjectionRefused,
    InjectionUnsafe,
    NotPython,
    ProbeAlreadyAttached,
    ProbeBusy,
    ProbeImpostor,
    ProbeStale,
    ProbeUnavailable,
    TraceUnavailable,
)
from dlprof_agent.probe_link import progress
from dlprof_agent.probe_link.client import ProbeClient, probe_socket_paths

log = logging.getLogger("dlprof_agent")
_T = TypeVar("_T")

SOCKET_WAIT_SECONDS = 10.0  # an injected bootstrap runs at the target's next safe point
LISTEN_WAIT_SECONDS = 5.0  # from its socket's bind to its listen, in a job starved of the GIL


@dataclass(frozen=True)
class ProbeOptions:
    inject: bool = True
    layers: bool = False
    split: bool = True  # the step's phases (forward, backward, optimizer, exchange, other)
    warmup_steps: int = 10
    wait_seconds: float = SOCKET_WAIT_SECONDS
    kernels: bool = True  # continuous CUPTI kernel tracing while the job uses CUDA
    layers_budget: float = 0.01  # share of step time layer timing may add
    layers_every: int = 0  # > 0: time one step in this many, whatever the budget
    # Silence after which the probe ends the session; None: the probe's own rule
    # (three intervals and a second, at least 2 s). Tests shorten it.
    lease_seconds: float | None = None
    max_series: int | None = None  # the target's series budget, applied as replies are read


def _start_options(options: ProbeOptions, interval: float) -> dict[str, object]:
    started: dict[str, object] = {"interval_seconds": interval, "layers": options.layers,
                                  "warmup_steps": options.warmup_steps,
                                  "agent_pid": os.getpid()}
    if not options.kernels:
        # Sent only when off: a probe older than kernel tracing refuses unknown options.
        started["kernels"] = False
    if not options.split:
        started["split"] = False  # likewise; a probe older than it splits only with layers
    if options.layers and options.layers_budget != 0.01:
        started["layers_budget"] = options.layers_budget  # likewise: only when not default
    if options.layers and options.layers_every:
        started["layers_every"] = options.layers_every
    if options.lease_seconds is not None:
        started["lease_seconds"] = options.lease_seconds  # likewise: only when set
    return started


def _next_socket(target: Target, refused: Mapping[str, str]) -> str | None:
    return next((path for path in probe_socket_paths(target.pid, procfs=target.procfs)
                 if path not in refused), None)


def _wait_for_socket(target: Target, seconds: float, refused: Mapping[str, str]
                     ) -> str | None:
    deadline = time.monotonic() + seconds
    while True:
        path = _next_socket(target, refused)
        if path is not None or time.monotonic() >= deadline or not target.is_running():
            return path
        time.sleep(0.05)


def _connect(pid: int, path: str, options: ProbeOptions, interval: float) -> ProbeClient:
    try:
        client = ProbeClient.connect(pid, path, _start_options(options, interval))
    except ProbeBusy as busy:
        which = f" (pid {busy.agent_pid})" if busy.agent_pid else ""
        raise ProbeAlreadyAttached(
            f"process {pid} already has an agent attached{which}",
            "scrape that agent, or stop it first"
            + (f" (kill {busy.agent_pid})" if busy.agent_pid else ""), pid=pid) from None
    client.max_series = options.max_series
    return client


class NoProbe(Exception):
    """Why the process has no probe to talk to, in plain words. ``final``: trying
    again cannot help while the process runs this program (not Python, ptrace
    denied, a socket someone else serves)."""

    def __init__(self, why: str, *, final: bool = False) -> None:
        super().__init__(why)
        self.final = final


def _reach_probe(target: Target, options: ProbeOptions, wait_seconds: float,
                 connect: Callable[[str], _T]) -> _T:
    """``connect(socket path)`` to the probe of the target, injecting one first where
    there is none and the options allow it. Raises NoProbe. Each step is said to
    ``progress`` while it waits."""
    try:
        return _reach_probe_steps(target, options, wait_seconds, connect)
    finally:
        progress.done(target.pid)


def _reach_probe_steps(target: Target, options: ProbeOptions, wait_seconds: float,
                       connect: Callable[[str], _T]) -> _T:
    pid = target.pid
    # Sockets someone else serves, refused, with why: never the end of the search,
    # since the real probe may listen elsewhere (its usual directory taken).
    refused: dict[str, str] = {}
    if wait_seconds > 0:
        progress.waiting_for(pid, "the probe the job starts itself")
    path = _wait_for_socket(target, wait_seconds, refused)
    while path is not None:
        try:
            progress.waiting_for(pid, "the probe's first answer")
            return connect(path)
        except ProbeBusy:
            raise
        except ProbeImpostor as error:
            refused[path] = f"{error}; someone may be impersonating the probe"
            log.info("pid %d: %s", pid, refused[path])
            path = _next_socket(target, refused)
        except ProbeStale as error:
            if not options.inject:
                raise NoProbe(f"the probe in it is gone: {error}") from None
            break  # a socket left by an earlier program in this process: inject afresh
        except ProbeUnavailable as error:
            # A probe is there but did not answer in time (the job may hold the
            # GIL, or another client may be slow): injecting another would not help.
            raise NoProbe(f"the probe in it did not answer: {error}") from None
    if not options.inject:
        if refused:
            raise NoProbe("; ".join(refused.values()))
        raise NoProbe("it has no probe and --no-inject was given; start the job with "
                       "DLPROF_PROBE=1 in its environment, with `dlprof-agent run -- ...`, "
                       "or call dlprof_agent.probe.enable() in it")
    from dlprof_agent.probe.bootstrap import injection_code
    from dlprof_agent.reach import inject

    try:
        progress.waiting_for(pid, "a thread of the job that waits in the kernel, to queue "
                             "the probe")
        queued = inject.inject(target, injection_code(), say_waiting=lambda what, tries:
                               progress.waiting_for(pid, what, tries=tries))
    except InjectionError as error:
        raise NoProbe(error.one_line(), final=isinstance(
            error, (NotPython, InjectionRefused, InjectionUnsafe))) from None
    progress.waiting_for(pid, "the queued probe to start (the job's main thread runs it "
                         "when it next runs Python code)")
    path = _wait_for_socket(target, options.wait_seconds, refused)
    if path is None:
        if queued is not None and queued.state() == "queued":
            raise NoProbe("the probe is queued in the job and starts by itself when its "
                           "main thread next runs Python code (it is in a long native call, "
                           "a sleep or I/O)")
        raise NoProbe(f"the injected probe did not start within {options.wait_seconds:g} s "
                       "(the main thread may be stuck in native code, or the job's Python "
                       "is older than 3.10)")
    try:
        progress.waiting_for(pid, "the injected probe's first answer")
        return _connect_once_listening(connect, path, LISTEN_WAIT_SECONDS)
    except ProbeBusy:
        raise
    except ProbeUnavailable as error:
        raise NoProbe(f"the injected probe did not answer: {error}") from None


def _connect_once_listening(connect: Callable[[str], _T], path: str, seconds: float) -> _T:
    """``connect(path)`` to a probe that is starting: its socket appears when it binds
    and answers once it listens, which other threads of a busy job, taking the GIL in
    between, can delay. Refused for up to ``seconds``, it is tried again."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return connect(path)
        except ProbeStale:
            if time.monotonic() >= deadline:
                raise
        time.sleep(0.02)


def connect_probe(target: Target, options: ProbeOptions, *, interval: float,
                  wait_seconds: float = 0.0) -> ProbeClient | None:
    """A started probe client, or None with the reason logged once."""
    try:
        return try_connect(target, options, interval, wait_seconds)
    except NoProbe as why:
        say_missing(target.pid, str(why))
        return None


def try_connect(target: Target, options: ProbeOptions, interval: float, wait_seconds: float
                ) -> ProbeClient:
    """A started probe client for the target; raises NoProbe (or ProbeAlreadyAttached)."""
    return _reach_probe(target, options, wait_seconds,
                        lambda path: _connect(target.pid, path, options, interval))


TRACE_INTERVAL_SECONDS = 1.0  # the trace client's own session: it polls well within the lease


def open_trace_channel(target: Target, options: ProbeOptions, trace_args: dict[str, object]
                       ) -> tuple[ProbeClient, dict[str, Any] | None]:
    """A connection to ask the probe of the target for a trace: our own session (the
    reply is None: say ``trace`` next), or, beside an attached agent, a second
    connection that said ``trace`` already (with the probe's reply)."""
    pid = target.pid

    def connect(path: str) -> tuple[ProbeClient, dict[str, Any] | None]:
        try:
            return ProbeClient.connect(pid, path, _start_options(
                options, TRACE_INTERVAL_SECONDS)), None
        except ProbeBusy:
            return ProbeClient.connect_beside(pid, path, {"command": "trace",
                                                          "args": trace_args})
    try:
        return _reach_probe(target, options, 0.0, connect)
    except ProbeBusy as busy:
        raise TraceUnavailable(
            f"process {pid} has an agent attached"
            + (f" (pid {busy.agent_pid})" if busy.agent_pid else "")
            + " whose probe is too old to trace beside it",
            "restart the job with this dlprof-agent version", pid=pid) from None
    except NoProbe as why:
        raise TraceUnavailable(f"no probe in process {pid}: {why}",
                               "kernel traces are taken by the in-process probe",
                               pid=pid) from None


def say_missing(pid: int, why: str, *, trying_again: bool = False) -> None:
    log.warning("no in-process metrics (steps, layers, framework settings) for pid %d: %s; "
                "the process, thread and GPU metrics are unaffected%s", pid, why,
                "; trying again on later passes" if trying_again else "")
