"""The code both injectors queue in a job as a *pending call*
(``Py_AddPendingCall(PyRun_SimpleString, page + 16)``), and what this agent has queued.

The main thread runs a pending call between two bytecodes, with the GIL held: at once
for a training loop; after a long C call holding the GIL, when that call returns. From
another thread than the main one, 3.10-3.12 set the main thread's eval breaker the
next time it takes the GIL (take_gil recomputes it, bpo-40010); 3.13 sets it directly.
Until it has run, ``pending_bootstrap`` returns it, so that injecting again queues no
second copy. PyRun_SimpleString returns -1 when the code raises, which the eval loop
turns into a SystemError in the job (a SystemExit would end it), so the queued source
catches everything and hands a KeyboardInterrupt back to the main thread.

The page holds a flag (the job writes ``ran`` there when it starts the code) and then
the source, whose own address it learns from a placeholder the injector fills in.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from dlprof_agent.collectors.target import Target
from dlprof_agent.reach.procfs import open_memory

FLAG_BYTES = 16  # at the start of the page: the job writes b"ran" there; the code follows
ADDRESS_PLACEHOLDER = "0xDLPROFAGENTADDR0"  # as wide as "%#018x" of a 64-bit address
_RAN = b"ran"

# Runs inside the target as PyRun_SimpleString(page + 16), from the main thread's eval
# loop with the GIL held. It must never let an exception out: PyRun_SimpleString would
# return -1, which the eval loop turns into a SystemError in the job (and a SystemExit
# would end it). Both levels run in their own namespaces: nothing lands in __main__.
_PENDING_BODY = """\
flag = {address}
try:
    with open('/proc/self/mem', 'r+b', buffering=0) as mem:
        mem.seek(flag)
        mem.write({ran!r})
except Exception:
    try:  # no /proc mounted (a bare chroot)
        __import__('ctypes').memmove(flag, {ran!r}, {size})
    except Exception:
        pass
try:
    exec({code!r}, {{'__name__': 'dlprof_agent_injected'}})
except BaseException as error:
    try:
        if isinstance(error, KeyboardInterrupt):
            __import__('_thread').interrupt_main()  # the job's Ctrl-C, handed back
        else:
            __import__('traceback').print_exc()
    except BaseException:
        pass
"""
_PENDING_SOURCE = """\
try:
    exec({body!r}, {{'__name__': 'dlprof_agent_injected'}})
except BaseException:
    pass
"""


@dataclass(frozen=True)
class QueuedBootstrap:
    """A bootstrap queued in a job as a pending call: the job runs it when its main
    thread next executes Python bytecode, which may be much later (a long C call)."""

    target: Target  # with its start time: tells the job from a reused pid
    address: int  # of the page in the job holding the flag and the code
    queued_at: float  # time.monotonic() in the agent

    def state(self) -> str:
        """"queued", "ran" (the job has started running the code), or "gone"."""
        if not self.target.is_running():
            return "gone"
        try:
            with open_memory(self.target.pid, procfs=self.target.procfs) as memory:
                memory.seek(self.address)
                flag = memory.read(len(_RAN))
        except OSError:
            return "queued" if self.target.is_running() else "gone"
        return "ran" if flag == _RAN else "queued"


_queued: dict[int, QueuedBootstrap] = {}
_queued_lock = threading.Lock()


def pending_bootstrap(target: Target) -> QueuedBootstrap | None:
    """The bootstrap this agent queued in the target that the job has not run yet.
    Injecting again meanwhile queues nothing: ``inject`` returns this one."""
    with _queued_lock:
        queued = _queued.get(target.pid)
    if queued is None:
        return None
    if queued.state() != "queued":
        with _queued_lock:
            if _queued.get(target.pid) is queued:
                del _queued[target.pid]
        return None
    return queued


def remember(queued: QueuedBootstrap) -> QueuedBootstrap:
    """Keep ``queued`` for ``pending_bootstrap`` until the job has run it."""
    with _queued_lock:
        _queued[queued.target.pid] = queued
    return queued


def pending_payload(code: str) -> bytes:
    body = _PENDING_BODY.format(address=ADDRESS_PLACEHOLDER, ran=_RAN, size=len(_RAN),
                                code=code)
    source = _PENDING_SOURCE.format(body=body).encode("utf-8")
    return bytes(FLAG_BYTES) + source + b"\0"

