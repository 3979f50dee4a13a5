"""Helpers of the tests. Waiting: poll for a precondition up to a deadline instead of
sleeping a fixed time, so a test is as fast as the machine allows and a slow machine
only makes it slower, never wrong."""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import pytest

from dlprof_agent.reach.cpus import this_cpu

T = TypeVar("T")

# The agent's own ptrace injector runs where its CPU has a place (reach/cpus.py), for
# jobs before Python 3.14
OWN_INJECTOR = this_cpu() is not None and not hasattr(sys, "remote_exec")
NO_OWN_INJECTOR = "the agent's own ptrace injector: x86-64 and arm64, before Python 3.14"
# A client's wait for the agent's answer: on a machine whose cores are busy (a
# parallel run on two cores) an answer may wait seconds for a CPU.
SCRAPE_TIMEOUT_SECONDS = 60.0


def _describe(predicate: Callable[[], object]) -> str:
    """The predicate's source line for a lambda, else its name."""
    name = getattr(predicate, "__qualname__", repr(predicate))
    if name.endswith("<lambda>"):
        try:
            return inspect.getsource(predicate).strip()
        except (OSError, TypeError):
            pass
    return str(name)


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.05, *,
               what: str | None = None) -> T:
    """Call ``predicate`` every ``interval`` seconds until it returns something
    truthy, and return that. An OSError counts as not yet (a server that is not
    listening yet refuses the connection). Past ``timeout`` seconds, raises
    AssertionError naming ``what`` was awaited (the predicate's source by default)
    and its last value or error."""
    deadline = time.monotonic() + timeout
    while True:
        last: object
        try:
            value = predicate()
        except OSError as error:
            last = error
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for "
                                 f"{what or _describe(predicate)} (last: {last!r})")
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))


def wait_while_progressing(predicate: Callable[[], T], progress: Callable[[], object],
                           stalled: float, *, what: str) -> T:
    """``wait_until`` for work whose length depends on the machine's load (a job that
    imports TensorFlow beside three others): it fails only once ``progress()`` has
    not changed for ``stalled`` seconds, not after a fixed time."""
    seen = progress()
    while True:
        try:
            return wait_until(predicate, stalled, interval=0.2, what=what)
        except AssertionError:
            now = progress()
            if now == seen:
                raise AssertionError(f"no progress in {stalled:g} s ({now!r}) "
                                     f"waiting for {what}") from None
            seen = now


def without_eval_loop_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    """The injector plans no busy-thread stop in the eval loop's own code (as where its
    extent is unknown): a pure-Python spin then has no safe point."""
    from dlprof_agent.collectors.target import Target
    from dlprof_agent.reach import inject as inject_module
    from dlprof_agent.reach.call_plan import CallAddresses, plan_calls
    from dlprof_agent.reach.runtime import PythonRuntime

    def planned(target: Target, runtime: PythonRuntime) -> CallAddresses | None:
        calls = plan_calls(target, runtime)
        if calls is None or calls.busy_stops is None:
            return calls
        return calls._replace(busy_stops=calls.busy_stops._replace(eval_loop=None))

    monkeypatch.setattr(inject_module, "plan_calls", planned)

