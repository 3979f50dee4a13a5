"""Runs a short bootstrap string inside an already-running CPython process: the one
entry point to the injectors, and the place that picks one. On Python 3.14+
``sys.remote_exec`` when the agent runs the job's minor version (``remote_exec``), else
the same protocol through the job's debug offsets (``remote_debug``), except where
the job's main thread waits in a lock (``waiting_main``): it would take the script
only when the wait returns, so the ptrace injector queues a pending call and ends
that wait with EINTR. Before 3.14, or where those offsets are not known, the agent's
own ptrace injector on x86-64 and arm64 (``ptrace``, ``cpu``), or gdb elsewhere
(``gdb``).

Two rules decide whether the job survives.

Where the code runs. A ptrace injector that stops a thread at an arbitrary instruction
and calls ``dlopen`` there deadlocks the job whenever that thread was inside ``malloc``
(measured: the ``hypno`` package hung a PyTorch job on about one attach in ten). So the
code is handed to the interpreter as a *pending call* (``Py_AddPendingCall``, see
``pending``): the main thread runs it between two bytecodes, with the GIL held, at a
point the interpreter chooses. Py_AddPendingCall needs neither the GIL nor a thread
state ("doesn't require the caller to hold the GIL", Python/ceval.c in 3.10 and 3.11;
3.12 and 3.13 ignore the caller's thread state and target the main interpreter). It
takes one lock around a fixed ring of 32 entries and allocates nothing: a PyThread lock
in 3.10-3.12 (``PyThread_acquire_lock(pending->lock, WAIT_LOCK)``), a PyMutex in 3.13
(Python/ceval_gil.c). It returns -1 only when the ring is full. Both injectors call it
from a thread that waits in the kernel (``threads``), never from one stopped at an
arbitrary instruction.

Nothing of ours may outlive the agent in the job. The old design left gdb waiting at a
breakpoint for a safe point, up to 10 s: a kill of the agent's side then (a systemd stop,
a cgroup kill, a container stop: gdb dies too) left an int3 that killed the job, or left
it stopped. Now the ptrace injector's borrowed thread restores itself (``rt_sigreturn``),
so the agent may die at any instant; gdb keeps a window of milliseconds per call.

Before any of this, ``inject`` checks the ELF dynamic symbol tables of the target's
executable and of any mapped ``libpython3*.so*`` (``runtime``, ``elf``), and touches the
process only when one of them defines the functions called.
"""

from __future__ import annotations

import contextlib
import os
import sys

from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import (
    InjectionFailed,
    InjectionNotNow,
    InjectionRefused,
    NotPython,
    TargetNotFound,
)
from dlprof_agent.reach.bootstrap_files import remove_stale_files
from dlprof_agent.reach.call_plan import CallAddresses, plan_calls
from dlprof_agent.reach.gdb import inject_with_gdb
from dlprof_agent.reach.lock_wait import ParkingLotWait
from dlprof_agent.reach.pending import QueuedBootstrap, pending_bootstrap
from dlprof_agent.reach.procfs import comm
from dlprof_agent.reach.ptrace import SayWaiting, inject_with_ptrace, say_nothing
from dlprof_agent.reach.remote_debug import (
    find_remote_debug,
    inject_with_remote_debug,
    opted_out,
)
from dlprof_agent.reach.remote_exec import inject_with_remote_exec
from dlprof_agent.reach.runtime import (
    MIN_TARGET_VERSION,
    PythonRuntime,
    find_python_runtime,
)
from dlprof_agent.reach.threads import exited_during_injection
from dlprof_agent.reach.waiting_main import main_thread_parked

# For a thread of the job to be seen waiting in the kernel, where the code is queued from.
SAFE_POINT_WAIT_SECONDS = 10.0
REMOTE_DEBUG_VERSION = (3, 14)  # PEP 768: the interpreter runs a script it is handed
# For the ptrace injector to borrow a 3.14 main thread seen in a lock wait: it ends
# the wait at once; if the wait returned meanwhile, PEP 768 takes over
_PARKED_WAIT_SECONDS = 2.0


def inject(target: Target, code: str, *, wait_seconds: float | None = None,
           say_waiting: SayWaiting = say_nothing) -> QueuedBootstrap | None:
    """Have the target run ``code`` once, on its main thread, with the GIL held.

    The job runs it at its own next safe point, which may come after this returns: the
    result (gdb) tells whether it has run yet, and while it has not, injecting again
    returns it instead of queueing a second copy. Keep the code short and idempotent:
    import the probe and let it start its own thread.
    Raises NotPython (nothing was done to the process), InjectionRefused (the kernel
    would not let the agent attach), InjectionNotNow (nothing was done; a later try may
    work) or InjectionFailed. A pid with no live process, or one that exits meanwhile,
    (or whose pid now names another process) raises
    ``dlprof_agent.errors.TargetNotFound``, like every other place the agent
    meets a missing target, so the command line exits with the same code (3).
    Errors in ``code`` itself happen in the target and print to its stderr.
    ``say_waiting(what, tries)`` hears what the injector waits for while it does.
    """
    pid = target.pid
    if pid == os.getpid():
        raise InjectionFailed("cannot inject into the agent's own process",
                              "give the training job's pid", pid=pid)
    runtime = find_python_runtime(target)
    if not target.is_running():
        # Whatever runs under its pid now is not the process the agent was given.
        raise TargetNotFound(f"process {pid} has exited", "attach to a running job", pid=pid)
    if runtime is None:
        raise NotPython(f"process {pid} ({comm(pid, procfs=target.procfs)}) is not a Python "
                        "process the probe can run in",
                        "give the pid of the python process running the training script; "
                        f"for a launcher or shell, list its children with `pgrep -a -P {pid}`",
                        pid=pid)
    if runtime.version is not None and runtime.version < MIN_TARGET_VERSION:
        major, minor = runtime.version
        raise NotPython(f"process {pid} runs python {major}.{minor}, too old for the probe",
                        "the probe needs python {}.{} or newer".format(*MIN_TARGET_VERSION),
                        pid=pid)
    remove_stale_files(target)
    try:
        return _inject(target, code, runtime,
                       SAFE_POINT_WAIT_SECONDS if wait_seconds is None else wait_seconds,
                       say_waiting)
    except TargetNotFound:
        # It was there a moment ago: say so, rather than that no such process exists.
        raise exited_during_injection(target) from None


def _inject(target: Target, code: str, runtime: PythonRuntime, wait_seconds: float,
            say_waiting: SayWaiting) -> QueuedBootstrap | None:
    remote_exec = getattr(sys, "remote_exec", None)
    if remote_exec is not None and runtime.version == sys.version_info[:2]:
        inject_with_remote_exec(target, code, remote_exec)
        return None
    queued = pending_bootstrap(target)
    if queued is not None:
        return queued
    calls = None
    if runtime.version is not None and runtime.version >= REMOTE_DEBUG_VERSION:
        # Another Python than the agent's: PEP 768's protocol by hand, before ptrace.
        table = find_remote_debug(target, runtime)
        if table is not None:
            calls = plan_calls(target, runtime)
            if calls is not None and _parked(target, calls) and opted_out(target, table) is None:
                # A main thread in a lock wait would take the script only when the
                # wait returns: the ptrace injector ends that wait with EINTR and
                # queues a pending call, which the interpreter runs before it waits
                # again. Where it cannot, nothing is queued: PEP 768's turn.
                with contextlib.suppress(InjectionNotNow, InjectionRefused):
                    return inject_with_ptrace(target, code, calls, _PARKED_WAIT_SECONDS,
                                              say_waiting=say_waiting)
            return inject_with_remote_debug(target, code, table)
    if calls is None:
        calls = plan_calls(target, runtime)
    if calls is not None:
        return inject_with_ptrace(target, code, calls, wait_seconds,
                                  say_waiting=say_waiting)
    return inject_with_gdb(target, code, wait_seconds, runtime)


def _parked(target: Target, calls: CallAddresses) -> bool:
    return isinstance(calls.lock_wait, ParkingLotWait) and main_thread_parked(
        target, calls.lock_wait)
