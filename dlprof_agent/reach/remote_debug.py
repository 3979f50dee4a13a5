"""PEP 768's remote exec done by the agent itself, for a Python 3.14+ job whose Python
is not the agent's (``sys.remote_exec`` only talks to its own minor version): the same
few writes into the job's memory that CPython's ``sys.remote_exec`` makes
(Python/remote_debugging.c, ``send_exec_to_proc_handle``), through /proc/<pid>/mem.

1. ``_PyRuntime`` is found through the dynamic symbol table of the job's python
   executable or libpython, and its first bytes are the ``_Py_DebugOffsets`` table
   (``debug_offsets``), cookie and version checked.
2. The first interpreter (``runtime_state.interpreters_head``) must have
   ``config.remote_debug`` set: ``PYTHON_DISABLE_REMOTE_DEBUG`` in its environment or
   ``-X disable-remote-debug`` (so spelt: 3.14's ``python -X help``) clear it, and then
   the job is left untouched.
3. In the main thread's state (``interpreter_state.threads_main``) the script's path
   goes into the remote-debugger support buffer, its pending flag is set to 1, and
   the eval breaker gets ``_PY_EVAL_PLEASE_STOP_BIT``.

The main thread runs the file at its next eval-breaker check, between two bytecodes
with the GIL held, and clears the flag. A main thread that waits in the kernel (a
sleep, a lock, ``join()``) makes no such check until the wait returns: the probe then
starts when it does, and until then the script stays queued (``QueuedRemoteExec``):
its file is kept until the flag is cleared, and withdrawn (the flag cleared by the
agent) when the agent exits first. Ending a lock wait with EINTR would not help the
script: an interrupted lock wait runs ``Py_MakePendingCalls``, which runs pending
calls but not the remote debugger's script. So ``inject`` hands a main thread seen in
a lock wait (``waiting_main``) to the ptrace injector instead, which queues a pending
call and ends that wait; this module then writes nothing.

No thread is stopped and nothing runs in the job but the interpreter's own code, so an
agent killed at any instant leaves at most a flag the job acts on once; the script's
folder names the job, and a later agent's cleanup keeps it while the job lives. Like CPython's
own, the eval breaker's update is a read and a write, not atomic: a bit the job sets
between the two (a GIL drop request) is lost and asked for again by its waiter.
"""

from __future__ import annotations

import atexit
import contextlib
import struct
import threading
import time
from dataclasses import dataclass

from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import (
    InjectionFailed,
    InjectionRefused,
    TargetGone,
    TargetNotFound,
    UnknownDebugOffsets,
)
from dlprof_agent.reach.bootstrap_files import Bootstrap, write_bootstrap
from dlprof_agent.reach.debug_offsets import (
    COOKIE,
    EVAL_PLEASE_STOP_BIT,
    READ_BYTES,
    DebugOffsets,
    parse_debug_offsets,
)
from dlprof_agent.reach.mapped_files import first_readable_elf, mapped_file_paths
from dlprof_agent.reach.pending import QueuedBootstrap, remember
from dlprof_agent.reach.procfs import (
    environment_value,
    executable,
    executable_path,
    memory_map,
    open_memory,
    running,
)
from dlprof_agent.reach.refusal import refused
from dlprof_agent.reach.runtime import PythonRuntime

DISABLE_ENV = "PYTHON_DISABLE_REMOTE_DEBUG"
_WATCH_SECONDS = 1.0  # how often the agent looks whether the job took its script
_OPT_OUT_HINT = ("the job turned off remote debugging, so the agent leaves it alone: "
                 f"start it without {DISABLE_ENV} and -X disable-remote-debug, or with "
                 "`dlprof-agent run -- ...`")


@dataclass(frozen=True)
class DebugTable:
    """A job's debug offsets, as read from it, and where its _PyRuntime is."""

    runtime_address: int
    offsets: DebugOffsets


def _runtime_address(target: Target, runtime: PythonRuntime) -> int | None:
    """Where ``_PyRuntime`` is in the target: its symbol's value, plus the load base of
    the file for a PIE or a shared library."""
    pid, procfs = target.pid, target.procfs
    try:
        exe = executable(pid, procfs=procfs)
    except TargetGone:
        return None
    maps = memory_map(pid, procfs=procfs)
    mapped = [start for start, _, _, offset, path in maps
              if path == runtime.library and offset == 0]
    # The executable through its link; a libpython through the job's root, then
    # map_files (``mapped_files``).
    files = ([executable_path(pid, procfs=procfs)] if runtime.library == exe
             else mapped_file_paths(target, runtime.library, maps))
    found = first_readable_elf(files)
    scan = found[1] if found is not None else None
    location = scan.location("_PyRuntime") if scan is not None else None
    if scan is None or location is None:
        return None
    value, _ = location
    if not scan.shared:
        return value
    return min(mapped) + value if mapped else None


@dataclass(frozen=True)
class QueuedRemoteExec(QueuedBootstrap):
    """A script handed to the job's main thread: ``address`` is its pending flag, which
    the job clears when it takes the script."""

    def state(self) -> str:
        """"queued", "ran" (the job took the script), or "gone"."""
        if not self.target.is_running():
            return "gone"
        try:
            flag = struct.unpack("<i", _read(self.target, self.address, 4))[0]
        except OSError:
            return "queued" if self.target.is_running() else "gone"
        return "queued" if flag == 1 else "ran"

    def withdraw(self) -> None:
        """Clear the flag of a script the job has not taken yet (the agent is leaving):
        the job then never opens a file that is about to be removed."""
        if self.state() == "queued":
            with contextlib.suppress(OSError):
                _write(self.target, self.address, struct.pack("<i", 0))


def _keep_until_taken(queued: QueuedRemoteExec, bootstrap: Bootstrap) -> None:
    """Remove the script once the job has taken it (or is gone); at the agent's exit,
    withdraw it first if the job has not. A fixed delay would not do: a main thread
    that waits takes it only when its wait returns, hours later maybe."""
    def leave() -> None:
        queued.withdraw()
        bootstrap.remove()

    def watch() -> None:
        while queued.state() == "queued":
            time.sleep(_WATCH_SECONDS)
        # The job opens the file right after clearing the flag: give it that moment.
        time.sleep(_WATCH_SECONDS)
        bootstrap.remove()

    atexit.register(leave)
    threading.Thread(target=watch, name=f"dlprof-remote-exec-{queued.target.pid}",
                     daemon=True).start()


def _read(target: Target, address: int, size: int) -> bytes:
    with open_memory(target.pid, procfs=target.procfs) as memory:
        memory.seek(address)
        data = memory.read(size)
    if len(data) != size:
        raise OSError(f"short read from process {target.pid}")
    return data


def _write(target: Target, address: int, data: bytes) -> None:
    with open_memory(target.pid, writable=True, procfs=target.procfs) as memory:
        memory.seek(address)
        if memory.write(data) != len(data):
            raise OSError(f"short write to process {target.pid}")


def _pointer(target: Target, address: int) -> int:
    value: int = struct.unpack("<Q", _read(target, address, 8))[0]
    return value


def find_remote_debug(target: Target, runtime: PythonRuntime) -> DebugTable | None:
    """The job's debug offsets, when it is a Python whose table is known here (3.14);
    None otherwise (an older or newer Python, a pre-release, no _PyRuntime symbol):
    another injector is used. Raises InjectionRefused when its memory may not be read."""
    address = _runtime_address(target, runtime)
    if address is None:
        return None
    try:
        raw = _read(target, address, READ_BYTES)
    except PermissionError:
        raise refused(target, "cannot read its memory") from None
    except OSError:
        return None
    if raw[:len(COOKIE)] != COOKIE:
        return None
    try:
        return DebugTable(address, parse_debug_offsets(raw))
    except UnknownDebugOffsets:
        return None


def opted_out(target: Target, table: DebugTable) -> str | None:
    """Why the job does not take remote debugging, in words; None when it does."""
    pid, offsets = target.pid, table.offsets
    interpreter = _pointer(target, table.runtime_address + offsets.interpreters_head)
    if interpreter == 0:
        raise InjectionFailed(f"process {pid} has no running interpreter yet (or any more)",
                              "attach once the job has started", pid=pid)
    enabled = struct.unpack("<i", _read(target, interpreter + offsets.remote_debugging_enabled,
                                        4))[0]
    if enabled == 1:
        return None
    if environment_value(pid, DISABLE_ENV, procfs=target.procfs):
        return f"{DISABLE_ENV} is set in its environment"
    return "it was started with -X disable-remote-debug (or built without remote debugging)"


def inject_with_remote_debug(target: Target, code: str, table: DebugTable
                             ) -> QueuedRemoteExec:
    """Have the main thread of the target run ``code`` at its next eval-breaker check;
    returns it, queued, until the job takes it. Raises InjectionRefused when the job
    opted out (nothing was written to it), TargetNotFound when it exits meanwhile,
    InjectionFailed otherwise."""
    pid, offsets = target.pid, table.offsets
    try:
        why = opted_out(target, table)
        if why is not None:
            raise InjectionRefused(f"process {pid} does not allow remote debugging: {why}",
                                   _OPT_OUT_HINT, pid=pid)
        interpreter = _pointer(target, table.runtime_address + offsets.interpreters_head)
        main = _pointer(target, interpreter + offsets.threads_main)
        if main == 0:
            raise InjectionFailed(f"process {pid} has no main thread state",
                                  "attach once the job has started", pid=pid)
        try:
            bootstrap = write_bootstrap(target, code, outlive_agent=True)
        except OSError as error:
            raise InjectionFailed(f"cannot write the bootstrap script: {error}",
                                  "make a temporary directory writable (TMPDIR)",
                                  pid=pid) from None
        path = bootstrap.seen_as.encode() + b"\0"
        if len(path) > offsets.debugger_script_path_size:
            bootstrap.remove()
            raise InjectionFailed(f"the bootstrap path {bootstrap.seen_as} is too long for "
                                  "the job's remote-debugger buffer",
                                  "set TMPDIR to a shorter directory", pid=pid)
        support = main + offsets.remote_debugger_support
        queued = QueuedRemoteExec(target, support + offsets.debugger_pending_call,
                                  time.monotonic())
        try:
            # Path first, then the flag, then the breaker: the job reads them in that order.
            _write(target, support + offsets.debugger_script_path, path)
            _write(target, support + offsets.debugger_pending_call, struct.pack("<i", 1))
            breaker = _pointer(target, main + offsets.eval_breaker)
            _write(target, main + offsets.eval_breaker,
                   struct.pack("<Q", breaker | EVAL_PLEASE_STOP_BIT))
        except BaseException:
            bootstrap.remove()
            raise
        # Only now: watched before the flag is set, it would read as taken at once
        # and the file would go before a waiting main thread opens it.
        _keep_until_taken(queued, bootstrap)
        remember(queued)
        return queued
    except PermissionError:
        raise refused(target, "cannot write its memory") from None
    except OSError as error:
        if isinstance(error, ProcessLookupError) or not running(pid, procfs=target.procfs):
            raise TargetNotFound(f"process {pid} exited before the probe could be injected",
                                 "attach to a running job", pid=pid) from None
        raise InjectionFailed(f"remote exec into process {pid} failed: {error}",
                              "check that the job is still running", pid=pid) from None
