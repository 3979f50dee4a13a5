"""The agent's channel to the probe in the target, kept across its loss: late
replies, a probe that stops answering, a connection that breaks (reached, or
injected, again off the sampling pass with a growing pause), and an exec that
puts another program behind the pid."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

from dlprof_agent.collectors.target import ProgramIdentity, Target, program_identity
from dlprof_agent.errors import ProbeAlreadyAttached, ProtocolError
from dlprof_agent.probe_link.client import REPLY_SECONDS, ProbeClient, ReplyLate
from dlprof_agent.probe_link.connect import NoProbe, ProbeOptions, say_missing, try_connect
from dlprof_agent.probe_link.samples import ProbeSample

log = logging.getLogger("dlprof_agent")

# A job that is exiting closes its probe, then may take seconds to tear down its
# framework (thread pools, allocators) before it is gone.
EXIT_GRACE_SECONDS = 5.0
# Imports and graph builds can hold the GIL, and so the probe's answer, for seconds.
LATE_LIMIT_SECONDS = 10.0
# Past this without an answer on an open connection, the probe is taken for lost
# and reached afresh; until then a late reply is still taken when it comes.
SILENT_LIMIT_SECONDS = 120.0
# Between tries to reach a lost probe: a failed injection costs seconds of gdb.
# Each try may attach gdb to the job: the pause grows to minutes.
RETRY_SECONDS = (2.0, 4.0, 8.0, 16.0, 30.0, 60.0, 120.0, 300.0)
# A reply's wait on the sampling pass: half an interval, within these bounds.
REPLY_WAIT_BOUNDS_SECONDS = (0.25, REPLY_SECONDS)
# Passes in a row whose reply began but did not end within its wait: a probe
# writes its reply at once, so one that trickles is not a job holding the GIL.
TRICKLE_LIMIT = 3


@dataclass(frozen=True)
class ChannelTimeouts:
    """How long the channel waits on the probe, each at its production value above;
    tests shorten them."""

    exit_grace_seconds: float = EXIT_GRACE_SECONDS
    late_limit_seconds: float = LATE_LIMIT_SECONDS
    silent_limit_seconds: float = SILENT_LIMIT_SECONDS
    retry_seconds: tuple[float, ...] = RETRY_SECONDS
    reply_wait_bounds_seconds: tuple[float, float] = REPLY_WAIT_BOUNDS_SECONDS
    trickle_limit: int = TRICKLE_LIMIT

    def reply_wait(self, interval: float) -> float:
        low, high = self.reply_wait_bounds_seconds
        return max(low, min(high, interval / 2))

    def exchange_deadline(self, interval: float) -> float:
        """A pass's wait for all its probes: a reply's wait, and time to decode it."""
        return self.reply_wait(interval) + max(0.1, interval / 4)


DEFAULT_TIMEOUTS = ChannelTimeouts()


class ProbeCondition(NamedTuple):
    """What the last pass got from the probe, for the status page: "ok" (a fresh
    sample), "stale" (the last good sample kept: its reply is late) or "dropped"
    (none: lost, or not reached yet), and why."""

    state: str
    reason: str = ""


class ProbeSource:
    """The agent's view of the probe: a sample per pass, or None while there is
    none to be had.

    It is on the sampling pass, so it never waits long: a reply gets half an interval
    (a stopped or stuck job must not hold up the process and GPU metrics). A reply
    that comes later is taken on a later pass; meanwhile the last sample stands, for
    up to LATE_LIMIT_SECONDS, and after that the probe counts as down while its reply
    is still awaited. A probe whose connection breaks is reached again (and, where
    options allow, injected again) off the sampling pass, with a growing pause
    between tries. Each change is said once: waiting, and back."""

    def __init__(self, client: ProbeClient | None, *, interval: float,
                 target: Target | None = None,
                 options: ProbeOptions | None = None,
                 identity: ProgramIdentity | None = None, waiting: str = "",
                 timeouts: ChannelTimeouts = DEFAULT_TIMEOUTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if target is None:
            assert client is not None, "a ProbeSource without a client needs its target"
            target = Target.of(client.pid)
        self.target = target
        self.client: ProbeClient | None = None
        self._interval = interval
        self._timeouts = timeouts
        self._clock = clock
        self._options = options  # None: never reach the probe again once lost
        self._identity = identity if identity is not None else program_identity(
            target.pid, procfs=target.procfs)
        self._lost: tuple[float, str] | None = None  # when, and why
        self._late_since: float | None = None
        self._last: ProbeSample | None = None
        self._kernel_state: tuple[str, str] | None = None
        self._answering = False
        self._waiting = waiting  # why there is no probe, once said
        self._tries = 0
        self._trickles = 0  # passes in a row whose reply began and did not end in time
        self._strikes = 0  # drops in a row for a trickling reply: the retries back off
        self._condition = ProbeCondition("ok") if client is not None else ProbeCondition(
            "dropped", waiting or "not reached yet")
        self._next_try = clock() + timeouts.retry_seconds[0]
        self._lock = threading.Lock()
        # Held through a read: a pass's worker may still be reading when stop() comes.
        self._reading = threading.Lock()
        self._connecting: threading.Thread | None = None
        self._reached: ProbeClient | None = None  # from the connecting thread
        self._reach_failure: str | None = None
        self._stopped = False
        self._adopted = False  # a client was ever taken
        self._layers_wanted: bool | None = None  # set_layers: sent at the next pass
        if client is not None:
            self._adopt(client)

    def _program(self) -> ProgramIdentity | None:
        return program_identity(self.target.pid, procfs=self.target.procfs)

    @property
    def up(self) -> bool:
        """A probe answers: connected, and not silent past the late limit."""
        return self.client is not None and self._answering

    def _adopt(self, client: ProbeClient) -> None:
        client.set_timeout(self._timeouts.reply_wait(self._interval))
        self.client, self._answering, self._late_since = client, True, None
        self._tries, self._lost = self._strikes, None
        self._trickles = 0
        self._adopted = True

    @property
    def condition(self) -> ProbeCondition:
        return self._condition

    def set_layers(self, layers: bool) -> None:
        """Layer timing on or off (`top`'s l): sent at the next pass, kept for a reach."""
        with self._lock:
            self._layers_wanted = layers
            if self._options is not None:
                self._options = replace(self._options, layers=layers)

    def _send_layers(self, client: ProbeClient) -> None:
        with self._lock:
            wanted, self._layers_wanted = self._layers_wanted, None
        if wanted is not None and wanted != client.layers:
            try:
                client.set_layers(wanted)
            except ReplyLate:  # its answer is taken before the next snapshot's
                client.layers = wanted
            except Exception:  # a closed socket: the snapshot below meets it and drops it
                pass

    def sample(self) -> ProbeSample | None:
        with self._reading:
            if self._stopped:
                return None
            sample = self._sample()
            if sample is None and self.client is not None:
                self._condition = ProbeCondition("stale", self._waiting or "no reply yet")
            elif sample is None:
                self._condition = ProbeCondition("dropped", self._waiting or (
                    self._lost[1] if self._lost is not None else "no probe"))
            return sample

    def _sample(self) -> ProbeSample | None:
        client = self.client
        if client is None:
            self._check_program(probe_answers=False)
            client = self._take_reached()
            if client is None:
                self._report_loss()
                self._try_again()
                return None
        if self._layers_wanted is not None and client.idle:
            self._send_layers(client)
        now = self._clock()
        # Read before asking: a reply read after an exec may have been sent before it.
        identity, asked = self._program(), client.requests_sent
        try:
            sample = client.snapshot()
        except ReplyLate as late:
            self._check_program(probe_answers=False)
            if self._late_since is None:
                self._late_since = now
            silent = now - self._late_since
            self._trickles = self._trickles + 1 if late.received_bytes else 0
            if self._trickles >= self._timeouts.trickle_limit:
                self._drop_trickling(client, late.received_bytes)
                return None
            if silent < self._timeouts.late_limit_seconds:
                if self._last is not None:
                    self._condition = ProbeCondition("stale", str(late))
                return self._last
            if silent >= self._timeouts.silent_limit_seconds:
                self._drop(client, f"no reply for {silent:.0f} s")
                return None
            if self._answering:
                self._answering = False
                self._say_waiting(f"it has not answered for {silent:.0f} s (the job may be "
                                  "holding the GIL in a long native call, or be stopped); "
                                  "its reply is still awaited")
            return None
        except ProtocolError as error:  # not what a probe sends: said now, not after a grace
            self._drop(client, str(error))
            self._lost = None
            self._say_waiting(f"refused its reply ({error})")
            return None
        except Exception as error:  # a closed socket
            self._drop(client, str(error) or type(error).__name__)
            self._check_program(probe_answers=False)
            return None
        if identity is not None:  # only a reply to this pass's request shows it outlived it
            self._check_program(probe_answers=True if client.replies_taken > asked else None,
                                identity=identity)
        if not self._answering or self._waiting:
            self._answering = True
            self._say_back(client)
        self._late_since, self._last = None, sample
        self._trickles = self._strikes = 0
        self._condition = ProbeCondition("ok")
        self._report_kernel_state(sample)
        return sample

    def final_sample(self) -> ProbeSample | None:
        """Once the target has gone: the reply its probe sent before it went (one
        that came late, still unread in the socket), else None. Its probe answers a
        last read at exit, and that reply holds the job's final totals."""
        client = self.client
        if client is None:
            return None
        try:
            sample = client.snapshot()  # the late reply, or a request that meets a closed socket
        except Exception:
            return None
        self._last = sample
        return sample

    def _drop_trickling(self, client: ProbeClient, received: int) -> None:
        """A reply that keeps coming a few bytes at a time: closed, and the probe
        reached again after a pause that grows while it keeps doing so."""
        why = (f"its reply trickled: {received} bytes in {self._trickles} passes, "
               "none of them whole")
        self._drop(client, why)
        retry = self._timeouts.retry_seconds
        self._next_try = self._clock() + retry[min(self._strikes, len(retry) - 1)]
        self._strikes += 1
        self._lost = None
        self._say_waiting(why)

    def _say_waiting(self, why: str) -> None:
        if not self._waiting:
            log.warning("waiting for the probe in pid %d: %s; in-process metrics resume "
                        "when it is back", self.target.pid, why)
        self._waiting = why

    def _say_back(self, client: ProbeClient) -> None:
        if self._waiting:
            log.info("probe back in pid %d (%s)", self.target.pid,
                     ", ".join(map(str, client.hello.get("frameworks", [])))
                     or "no framework imported yet")
        self._waiting = ""

    def _check_program(self, *, probe_answers: bool | None,
                       identity: ProgramIdentity | None = None) -> None:
        """After exec the pid runs a new program: say so, and reach its probe afresh.
        A new command line under the same executable while the probe still answers
        is a job renaming itself (setproctitle), not an exec: exec closes the probe.
        ``probe_answers``: whether it answered a request sent after ``identity`` was
        read (read now if not given); None: this pass cannot tell (a held sample, or
        a late reply to an earlier pass), so a new command line waits for one that can."""
        if identity is None:
            identity = self._program()
        previous = self._identity
        if identity is None or previous is None or identity == previous:
            return
        if identity.executable == previous.executable:
            if probe_answers is None:
                return
            if probe_answers:
                self._identity = identity
                return
        self._identity = identity
        log.warning("process %d now runs another program (exec): %s, was %s; its metrics "
                    "from here on are the new program's", self.target.pid, identity.describe(),
                    previous.describe())
        client = self.client
        if client is not None:
            self._drop(client, "the process exec'd a new program")
        self._lost = None  # said just now
        self._waiting = "the process exec'd a new program"
        self._next_try = self._clock()  # reach the new program's probe at once
        self._tries = 0

    def _try_again(self) -> None:
        options = self._options
        if options is None or self._stopped or not self.target.is_running():
            return
        with self._lock:
            if self._connecting is not None or self._clock() < self._next_try:
                return
            retry = self._timeouts.retry_seconds
            self._next_try = self._clock() + retry[min(self._tries, len(retry) - 1)]
            self._tries += 1
            self._connecting = threading.Thread(
                target=self._reach, args=(options,), name=f"dlprof-probe-{self.target.pid}",
                daemon=True)
            self._connecting.start()

    def _reach(self, options: ProbeOptions) -> None:
        """Off the sampling pass: a connection, and perhaps an injection."""
        client: ProbeClient | None = None
        failure: str | None = None
        final = False
        try:
            client = try_connect(self.target, options, self._interval, 0.0)
        except ProbeAlreadyAttached as error:
            failure = error.one_line()
        except NoProbe as why:
            failure, final = str(why), why.final
        except Exception as error:  # the process metrics go on regardless
            failure = str(error) or type(error).__name__
        with self._lock:
            self._connecting = None
            if self._stopped:
                pass
            elif client is not None:
                self._reached, client = client, None
            else:
                self._reach_failure = failure
                if final:
                    self._next_try = float("inf")
        if client is not None:
            client.stop()  # stopped meanwhile: the probe removes its hooks

    def give_up_until_exec(self) -> None:
        """Trying again cannot help while the process runs this program (not
        Python, ptrace denied, a socket someone else serves)."""
        with self._lock:
            self._next_try = float("inf")

    def _take_reached(self) -> ProbeClient | None:
        with self._lock:
            client, self._reached = self._reached, None
            failure, self._reach_failure = self._reach_failure, None
        if failure is not None:
            self._say_waiting(failure)
        if client is not None:
            self._adopt(client)
        return client

    def _report_kernel_state(self, sample: ProbeSample) -> None:
        """Say once per change what the kernel tracer does, and why not."""
        kernels = sample.kernels
        if kernels is None or (kernels.state, kernels.reason) == self._kernel_state:
            return
        self._kernel_state = (kernels.state, kernels.reason)
        log.info("kernel tracing in pid %d: %s%s", self.target.pid, kernels.state,
                 f" ({kernels.reason})" if kernels.reason else "")

    def _drop(self, client: ProbeClient, why: str) -> None:
        self.client, self._answering, self._late_since = None, False, None
        client.close()
        self._lost = (self._clock(), why)
        self._kernel_state = None
        self._next_try = self._clock()  # the first try comes after the exit grace

    def _report_loss(self) -> None:
        if self._lost is None:
            return
        since, why = self._lost
        if not self.target.is_running():
            self._lost = None  # the job ended: nothing to report
            self._next_try = float("inf")
        elif self._clock() - since >= self._timeouts.exit_grace_seconds:
            self._lost = None
            again = "; trying to reach it again" if self._options is not None else (
                "; in-process metrics stop here")
            log.warning("lost the probe in pid %d (%s)%s", self.target.pid, why, again)
            self._waiting = why
        else:
            self._next_try = max(self._next_try, since + self._timeouts.exit_grace_seconds)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            reached, self._reached = self._reached, None
        with self._reading:
            client, self.client = self.client, None
            answering = self._condition.state == "ok"
        if client is not None and not answering:
            # Its reply is late or trickles: waiting for the answer to "stop" would
            # take as long. A probe whose agent hangs up removes its hooks as well.
            client.close()
        elif client is not None:
            client.stop()
        if reached is not None:
            reached.stop()
        elif client is None and not self._adopted:
            self._stop_unclaimed()

    def _stop_unclaimed(self) -> None:
        """A probe this channel may have injected but never got an answer from
        (a first reply too slow on a loaded machine) waits for an agent for a
        minute: claim it and stop it, so that nothing of the agent stays."""
        options = self._options
        if options is None or not options.inject or not self.target.is_running():
            return
        try:
            client = try_connect(self.target, replace(options, inject=False), self._interval,
                                 0.0)
        except Exception:  # none, or another agent's: nothing of ours to stop
            return
        client.stop()


def open_probe(target: Target, options: ProbeOptions, *, interval: float,
               wait_seconds: float = 0.0,
               timeouts: ChannelTimeouts = DEFAULT_TIMEOUTS) -> ProbeSource:
    """The probe channel for the target: connected now, or waiting for a probe that
    later passes keep trying to reach. Raises ProbeAlreadyAttached."""
    identity = program_identity(target.pid, procfs=target.procfs)
    final = False
    try:
        client: ProbeClient | None = try_connect(target, options, interval, wait_seconds)
        why = ""
    except NoProbe as error:
        client, why, final = None, str(error), error.final
        say_missing(target.pid, why, trying_again=not final)
    source = ProbeSource(client, interval=interval, target=target, options=options,
                         identity=identity, waiting=why, timeouts=timeouts)
    if final:
        source.give_up_until_exec()
    return source
