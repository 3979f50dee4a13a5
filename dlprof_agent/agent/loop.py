"""What the agent's loop needs besides its pass (snapshot_builder): passes on
fixed deadlines, SIGTERM as a stop, and the /healthz verdict on the age of the
latest sample."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, TypeVar

from dlprof_agent.model.snapshot import NodeSnapshot, Snapshot

_Published = TypeVar("_Published", Snapshot, NodeSnapshot)

Health = Callable[[], tuple[bool, dict[str, Any]]]


def run_on_deadlines(stop: threading.Event, interval_seconds: float,
                     one_pass: Callable[[], bool],
                     clock: Callable[[], float] = time.monotonic) -> None:
    """Call ``one_pass`` every interval until ``stop`` is set or it returns False.

    Deadlines are fixed multiples of the interval, so a slow pass delays
    the next one without shifting the ones after it.
    """
    next_deadline = clock()
    while not stop.is_set():
        if not one_pass():
            return
        next_deadline += interval_seconds
        now = clock()
        if next_deadline < now:  # overran: skip the missed ticks
            missed = int((now - next_deadline) // interval_seconds) + 1
            next_deadline += missed * interval_seconds
        stop.wait(next_deadline - now)


class StopRequested(BaseException):
    """SIGTERM. A BaseException, as KeyboardInterrupt is: a collector read guarded
    by ``except Exception`` that it lands in must not swallow it."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise StopRequested


@contextmanager
def sigterm_stops() -> Iterator[None]:
    """Within the block, SIGTERM raises StopRequested in the main thread."""
    previous = signal.signal(signal.SIGTERM, _raise_stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def sample_health(latest: Callable[[], _Published | None], interval_seconds: float,
                  details: Callable[[_Published | None], dict[str, Any]]) -> Health:
    """/healthz: healthy while the latest sample is younger than three intervals
    (and a second); ``details`` says, from that sample, what the loop watches."""

    def health() -> tuple[bool, dict[str, Any]]:
        published = latest()
        age = None if published is None else time.monotonic() - published.monotonic_seconds
        healthy = age is not None and age < 3 * interval_seconds + 1
        return healthy, {**details(published), "last_sample_age_seconds": age}

    return health
