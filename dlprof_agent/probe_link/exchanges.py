"""Every target's probe read at once, each within a deadline, so that one target
never delays another: a probe that answers late, or a byte at a time, costs its
own target a fresh sample and nothing else.

A small bounded pool of threads, not a selector or asyncio: a probe read is
`ProbeSource.sample()`, blocking code that also checks the target's program in
/proc, takes a client reconnected in the background and says what changed. A
pool runs it as it is, and `ProbeClient` bounds each reply's whole time, so a
worker is held no longer than one reply's wait and the decoding of it. The
bound on workers keeps a node of many jobs from starting a thread per job.

A read still running at the pass's deadline is a miss: the target keeps its
last good sample, marked stale, and the miss is counted. The next pass starts
no second read of that probe while the first runs (a channel is not
thread-safe); when the first ends, the next pass takes what it got."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from dlprof_agent.probe_link.samples import ProbeSample

WORKERS = 8  # reads at once; more targets than that wait their turn within the deadline


class ProbeRead(Protocol):
    def sample(self) -> ProbeSample | None: ...


@runtime_checkable
class ReportsCondition(Protocol):
    """A probe reader that says whether what it returned is fresh (ProbeSource)."""

    @property
    def condition(self) -> tuple[str, str]: ...


class Exchange(NamedTuple):
    """One target's probe in one pass."""

    sample: ProbeSample | None
    stale: bool  # the last good sample, kept: this pass got no fresh one in time
    misses: int  # passes so far whose read missed its deadline


_Read = concurrent.futures.Future[tuple[ProbeSample | None, bool]]


@dataclass
class _Target:
    running: _Read | None = None
    last: ProbeSample | None = None
    misses: int = 0


def _read(reader: ProbeRead) -> tuple[ProbeSample | None, bool]:
    """A sample, and whether it is the channel's last one kept while a reply is
    late: a miss as well."""
    sample = reader.sample()
    late = isinstance(reader, ReportsCondition) and reader.condition[0] == "stale"
    return sample, late


class ProbeExchanges:
    """The probe reads of one sampling loop, concurrent and each bounded."""

    def __init__(self, *, deadline_seconds: float,
                 on_error: Callable[[int, Exception], None], workers: int = WORKERS) -> None:
        self.deadline_seconds = deadline_seconds
        self._on_error = on_error
        self._workers = workers
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._targets: dict[int, _Target] = {}
        self._lock = threading.Lock()

    def read(self, readers: Sequence[tuple[int, ProbeRead | None]]) -> list[Exchange]:
        """Each reader's sample, in order, within one deadline for all of them."""
        wanted = {pid for pid, reader in readers if reader is not None}
        for pid in set(self._targets) - wanted:  # gone from the pass
            del self._targets[pid]
        for pid, reader in readers:
            if reader is None:
                continue
            target = self._targets.setdefault(pid, _Target())
            if target.running is not None and target.running.done():
                self._settle(pid, target, target.running)  # ended after its own pass
            if target.running is None:
                target.running = self._submit(reader)
        running = [target.running for target in self._targets.values()
                   if target.running is not None]
        concurrent.futures.wait(running, timeout=self.deadline_seconds)
        return [self._outcome(pid, reader) for pid, reader in readers]

    def _submit(self, reader: ProbeRead) -> _Read:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self._workers, thread_name_prefix="dlprof-exchange")
            return self._pool.submit(_read, reader)

    def _outcome(self, pid: int, reader: ProbeRead | None) -> Exchange:
        if reader is None:
            return Exchange(None, False, 0)
        target = self._targets[pid]
        running = target.running
        if running is not None and running.done():
            fresh = self._settle(pid, target, running)
            if fresh:
                return Exchange(target.last, False, target.misses)
        target.misses += 1
        return Exchange(target.last, target.last is not None, target.misses)

    def _settle(self, pid: int, target: _Target,
                done: _Read) -> bool:
        """Take a finished read; True when it brought a fresh sample, or none
        because the probe is down (nothing stale to keep)."""
        target.running = None
        try:
            sample, late = done.result()
        except Exception as error:
            self._on_error(pid, error)
            target.last = None
            return True
        # The channel's word stands: its last sample while a reply is late, none
        # once it counts the probe as down.
        target.last = sample
        return not late

    def close(self) -> None:
        """Start no more reads; a read in progress ends within its own deadline."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
