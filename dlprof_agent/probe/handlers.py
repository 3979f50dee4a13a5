"""What the probe answers: one table from command to handler, and the rules for
which connection may say what.

- The first frame of a new connection must be ``start`` (``open_session``); its
  reply is the hello.
- The attached agent's connection may say any command in ``HANDLERS``.
- While an agent is attached, a second connection may say ``trace``: it becomes
  the trace client beside the agent (``answer_second``), which may say the
  commands marked ``beside``. Anyone else hears that the probe is busy.

A handler gets the session and the request's ``args``, unchecked (a handler
checks what it reads: ValueError is a malformed request), and returns the reply.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

from dlprof_agent.probe.messages import (
    ErrorReply,
    Frame,
    HelloReply,
    OkReply,
    SnapshotReply,
    TraceStarted,
    TraceStatus,
)
from dlprof_agent.probe.protocol import COMMANDS, VERSION
from dlprof_agent.probe.session import DEFAULT_OPTIONS, Session, checked_options

Reply = HelloReply | SnapshotReply | OkReply | TraceStarted | TraceStatus | ErrorReply
# Why the probe dropped a message -> how many times: sent in the snapshot reply.
Dropped = dict[str, int]
# What this probe does beyond the first protocol's commands, told in its hello.
CAPABILITIES = ("kernels", "trace")


@dataclass(frozen=True, slots=True)
class Handler:
    answer: Callable[[Session, object, Dropped], Reply]
    beside: bool = False  # a trace client beside the agent may say it too
    ends_session: bool = False  # the session ends once the reply is sent


def _snapshot(session: Session, args: object, dropped: Dropped) -> SnapshotReply:
    session.install_new_hooks(dropped)
    session.tracer.tick()
    probe = session.recorder.snapshot()
    probe["cpu_seconds"] = session.cpu_seconds()
    return {"ok": True, "probe": probe, "settings": session.settings(),
            "dropped": dict(dropped), "kernels": session.tracer.snapshot()}


def _configure(session: Session, args: object, dropped: Dropped) -> OkReply:
    session.reconfigure(checked_options(args, session.options()), dropped)
    return {"ok": True}


def _trace(session: Session, args: object, dropped: Dropped) -> TraceStarted | ErrorReply:
    return session.start_trace(args)


def _trace_status(session: Session, args: object, dropped: Dropped) -> TraceStatus:
    return session.trace_status(args)


def _stop(session: Session, args: object, dropped: Dropped) -> OkReply:
    return {"ok": True}


# Every command of a session. ``start`` opens one: see open_session.
HANDLERS: dict[str, Handler] = {
    "snapshot": Handler(_snapshot),
    "configure": Handler(_configure),
    "trace": Handler(_trace, beside=True),
    "trace_status": Handler(_trace_status, beside=True),
    "stop": Handler(_stop, ends_session=True),
}


def count(dropped: Dropped, reason: str) -> None:
    dropped[reason] = dropped.get(reason, 0) + 1


def count_refused(command: object, dropped: Dropped) -> None:
    """A command not served here: one the protocol does not know, or one out of place."""
    count(dropped, "unknown" if command not in COMMANDS else "malformed")


def answer(session: Session, message: Frame, dropped: Dropped, *, beside: bool = False
           ) -> tuple[Reply, bool]:
    """The reply to a session's request, and whether the session ends after it;
    ``beside``: from the trace client beside the agent."""
    command = message.get("command")
    handler = HANDLERS.get(command) if isinstance(command, str) else None
    if handler is None or (beside and not handler.beside):
        count_refused(command, dropped)
        return {"ok": False, "error": "only trace commands here" if beside
                else "unknown command"}, False
    try:
        return handler.answer(session, message.get("args", {}), dropped), handler.ends_session
    except ValueError as error:
        count(dropped, "malformed")
        return {"ok": False, "error": str(error)}, False


def answer_second(session: Session, message: Frame, peer_uid: int, side_taken: bool,
                  dropped: Dropped) -> tuple[Reply, bool]:
    """The reply to a second connection's first frame while an agent is attached,
    and whether that connection is now the trace client beside the agent. Another
    agent hears that the probe is busy (and with whom only when it could see that
    agent's processes anyway: root, or the attached agent's own user)."""
    command = message.get("command")
    if command == "trace" and not side_taken:
        reply, _ = answer(session, message, dropped, beside=True)
        return reply, bool(reply.get("ok"))
    if command == "trace":
        return {"ok": False, "error": "tracing busy: another trace client is connected"}, False
    if command == "start":
        busy: ErrorReply = {"ok": False, "error": "busy"}
        if peer_uid in (0, session.peer_uid):
            busy["agent_pid"] = session.peer_pid
        return busy, False
    count_refused(command, dropped)
    return {"ok": False, "error": "busy"}, False


def open_session(connection: socket.socket, peer_pid: int, peer_uid: int, message: Frame,
                 dropped: Dropped) -> tuple[Session | None, ErrorReply | None]:
    """A new connection's first frame, with no agent attached: ``start`` (StartArgs)
    opens a session (then answered by ``hello``); anything else is refused."""
    command = message.get("command")
    if command != "start":
        count_refused(command, dropped)
        return None, {"ok": False, "error": "say start first"}
    try:
        options = checked_options(message.get("args", {}), DEFAULT_OPTIONS)
    except ValueError as error:
        count(dropped, "malformed")
        return None, {"ok": False, "error": str(error)}
    return Session(connection, peer_pid, peer_uid, options), None


def hello(session: Session, dropped: Dropped, *, pid: int, persistent: bool) -> HelloReply:
    """The reply to ``start``, once the session is the probe's: the hooks of the
    frameworks imported so far go in first."""
    session.install_new_hooks(dropped)
    return {"ok": True, "version": VERSION, "pid": pid, "python": sys.version.split()[0],
            "persistent": persistent, "frameworks": sorted(session.hooks),
            "capabilities": list(CAPABILITIES)}
