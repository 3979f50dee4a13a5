"""Reaching for the probe while `attach` already serves: the first connection,
or injection, runs on a thread of its own, so that /metrics serves the process,
thread and GPU metrics from the first second and a job that ends meanwhile ends
the attach as any job's end does. ``note()`` says, for the progress line, what
the start waits for; the target's watch gets the channel once it is open. The
daemon starts each of its targets' probes the same way."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import DlprofError, TargetNotFound
from dlprof_agent.probe_link import progress
from dlprof_agent.probe_link.channel import (
    DEFAULT_TIMEOUTS,
    ChannelTimeouts,
    ProbeSource,
    open_probe,
)
from dlprof_agent.probe_link.connect import NoProbe, ProbeOptions, try_connect

log = logging.getLogger("dlprof_agent")

# After a stop, how long an injection under way may take to end, so that the
# probe it started is stopped too, within the 5 s a stop may take.
STOP_INJECTION_WAIT_SECONDS = 3.0
# A start that takes longer is said once in a message, where no terminal line shows it.
SLOW_START_SECONDS = 5.0


class ProbeStart:
    """``open_probe`` for one target, off the main thread. ``on_open`` gets the
    channel once it is open (connected, or waiting for a probe that later passes
    keep trying to reach). After ``abandon`` the probe it reaches is stopped,
    whenever it comes up."""

    def __init__(self, target: Target, options: ProbeOptions, *, interval: float,
                 wait_seconds: float = 0.0, timeouts: ChannelTimeouts = DEFAULT_TIMEOUTS,
                 on_open: Callable[[ProbeSource], None] = lambda source: None,
                 on_error: Callable[[Exception], None] | None = None) -> None:
        self.target = target
        self._on_error = on_error
        self._options = options
        self._interval = interval
        self._wait_seconds = wait_seconds
        self._timeouts = timeouts
        self._on_open = on_open
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._abandoned = False
        self._stopping = False  # the attach is ending: a probe that comes is not news
        self._source: ProbeSource | None = None
        self._failure: DlprofError | None = None
        self._started_at = time.monotonic()
        self._said_slow = False
        self._thread = threading.Thread(target=self._open, name="dlprof-attaching",
                                        daemon=True)

    def open_running(self) -> ProbeSource | None:
        """The channel to a probe that already listens (started by `run` or by the
        job itself), in milliseconds and before the first sample, so that it holds
        the probe's figures; None where there is none yet: then ``start``.
        Raises ProbeAlreadyAttached."""
        if self._wait_seconds > 0:
            return None  # `run`: the job has yet to start its probe
        try:
            client = try_connect(self.target, replace(self._options, inject=False),
                                 self._interval, 0.0)
        except NoProbe:
            return None
        source = ProbeSource(client, interval=self._interval, target=self.target,
                             options=self._options, timeouts=self._timeouts)
        with self._lock:
            self._source = source
        self._done.set()
        self._announce(source)
        self._on_open(source)
        return source

    def start(self) -> None:
        self._started_at = time.monotonic()
        self._thread.start()

    def _announce(self, source: ProbeSource) -> None:
        if (client := source.client) is not None:
            log.info("probe active in pid %d after %.1f s (%s)", self.target.pid,
                     time.monotonic() - self._started_at,
                     ", ".join(map(str, client.hello.get("frameworks", [])))
                     or "no framework imported yet")

    @property
    def source(self) -> ProbeSource | None:
        """The channel, once open and while the start is not abandoned."""
        with self._lock:
            return self._source

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def failure(self) -> DlprofError | None:
        """An error that ends the attach (another agent holds the probe), once."""
        with self._lock:
            failure, self._failure = self._failure, None
        return failure

    def _open(self) -> None:
        source: ProbeSource | None = None
        failure: DlprofError | None = None
        try:
            source = open_probe(self.target, self._options, interval=self._interval,
                                wait_seconds=self._wait_seconds, timeouts=self._timeouts)
        except TargetNotFound:
            pass  # the job ended meanwhile: the next pass sees it, and the attach ends as usual
        except DlprofError as error:
            failure = error
        except Exception as error:  # the job's process metrics go on regardless
            if self._on_error is None:
                raise
            self._on_error(error)
        with self._lock:
            late = self._abandoned
            if not late:
                self._source, self._failure = source, failure
            # Under the lock: a stop that says "stopped by ..." first calls quiet(),
            # so that line stays the last.
            if source is not None and not late and not self._stopping:
                self._announce(source)
        if source is not None and late:
            source.stop()  # the agent is stopping: the probe removes its hooks
        elif source is not None:
            self._on_open(source)
        self._done.set()

    def note(self) -> str:
        """What the start waits for, for the progress line; "" once it is over."""
        if self._done.is_set():
            return ""
        step = progress.current(self.target.pid)
        seconds = time.monotonic() - self._started_at
        if step is None:
            return f"reaching for the probe ({seconds:.0f} s)"
        what, _, tries = step
        return (f"reaching for the probe: waiting for {what} ({seconds:.0f} s"
                + (f", try {tries})" if tries > 1 else ")"))

    def say_if_slow(self) -> None:
        """Once the start has taken SLOW_START_SECONDS, say once what it waits for and
        what the user can do meanwhile (for a log, where no progress line shows it)."""
        if (self._said_slow or self._done.is_set()
                or time.monotonic() - self._started_at < SLOW_START_SECONDS):
            return
        self._said_slow = True
        step = progress.current(self.target.pid)
        log.info("still reaching for the probe in pid %d%s; /metrics serves the process, "
                 "thread and GPU metrics meanwhile, and the step and layer metrics join "
                 "them once it answers (Ctrl-C stops; `dlprof-agent run -- python ...` "
                 "starts a job with the probe in it)", self.target.pid,
                 f": waiting for {step[0]}" if step is not None else "")

    def quiet(self) -> None:
        """The attach is stopping: a probe that comes up from now on is not announced."""
        with self._lock:
            self._stopping = True

    def abandon(self, wait_seconds: float = STOP_INJECTION_WAIT_SECONDS) -> None:
        """The target is let go: wait up to ``wait_seconds`` for an injection under
        way, so that the probe it started is stopped now; one that comes later is
        stopped by the start's own thread."""
        with self._lock:
            self._stopping = True
        if self._thread.ident is not None and wait_seconds > 0:
            self._done.wait(wait_seconds)
        with self._lock:
            self._abandoned = True
