"""The probe's socket server: one daemon thread that sleeps on a Unix socket
until an agent connects, reads frames as they come, and hands each to the
command handlers (``handlers.py``), imported when the first connection comes:
until then the probe is a thread and a socket, cheap to start in every process.

Safety outranks everything here. Every failure is caught and counted, and when
the agent goes away (closed socket, or silence longer than the lease) the hooks
are removed within one interval. A probe that was injected also closes its
socket then, leaving only imported modules.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from typing import TYPE_CHECKING

from dlprof_agent.errors import ConnectionClosed, ProtocolError
from dlprof_agent.probe.protocol import (
    MAX_REQUEST_BYTES,
    bytes_wanted,
    encode,
    own_private_dir,
    peer_credentials,
    private_dir,
    read_frame,
    remove_stale_sockets,
    runtime_dir_candidates,
    socket_name,
    take_frame,
)

if TYPE_CHECKING:
    from dlprof_agent.probe.handlers import Reply
    from dlprof_agent.probe.messages import Frame
    from dlprof_agent.probe.session import Session

HANDSHAKE_SECONDS = 5.0  # a new connection's first frame must arrive whole within this
FRAME_SECONDS = 2.0  # a frame, once begun, must arrive whole within this
ORPHAN_SECONDS = 60.0  # an injected probe no agent connects to closes after this
# A probe started with the job and no agent attached wakes only this often (to
# see a close() from another thread): every Python process may have one.
DORMANT_WAKE_SECONDS = 30.0
MAX_PENDING = 8  # connections not yet past their first frame; the oldest goes first
# Past this, a wake-up of the probe's thread is late because the job kept it off
# the GIL (or the process was stopped): that time does not count against a lease.
STARVED_SECONDS = 0.25
# At the job's exit the attached agent gets one more read of the totals, so that
# the steps since its last read reach /metrics: the job waits for it up to this
# many of the agent's intervals (its next read is due within one; the second is
# for an agent that runs late), and never longer than EXIT_READ_MAX_SECONDS.
EXIT_READ_INTERVALS = 2.0
EXIT_READ_MAX_SECONDS = 3.0


def _readable(sockets: list[socket.socket], timeout: float) -> list[socket.socket]:
    """Those of ``sockets`` with something to read (or a hang-up to see). poll,
    not select: a job with a thousand files open gives descriptors select cannot
    watch."""
    poller = select.poll()
    for each in sockets:
        poller.register(each, select.POLLIN)
    ready = {fd for fd, _ in poller.poll(max(0, int(timeout * 1000)))}
    return [each for each in sockets if each.fileno() in ready]


def _follow_main_thread_cpus() -> None:
    """A probe started at launch was made before the job pinned its main thread
    (a rank bound to its cores): once it has work, it runs on those cores too."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, os.sched_getaffinity(os.getpid()))  # the main thread's tid


class _Pending:
    """A connection whose first frame has not arrived whole. It is read as bytes
    come, between the probe's other work: a slow client holds nothing up."""

    def __init__(self, connection: socket.socket, peer_pid: int, peer_uid: int) -> None:
        self.connection = connection
        self.peer_pid = peer_pid
        self.peer_uid = peer_uid
        self.received = bytearray()
        self.deadline = time.monotonic() + HANDSHAKE_SECONDS


class Probe:
    """The listening socket, the connections not yet past their first frame, the
    attached agent's session and a trace client beside it; all on one thread."""

    def __init__(self, *, persistent: bool) -> None:
        self.persistent = persistent
        self.pid = os.getpid()
        self.path = ""
        self._own_dir: str | None = None  # made by listen() when the usual places are taken
        self.dropped: dict[str, int] = {}
        self.session: Session | None = None
        self._side: socket.socket | None = None  # a trace client beside the agent
        self._pending: list[_Pending] = []
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._started = time.monotonic()
        self._had_session = False
        self._wake_by: float | None = None  # when select should have returned at the latest
        self._reads = 0  # snapshots the attached agent has had
        self._steps_read = 0  # the steps counted when the last one was taken

    # Start and stop, from whoever enables the probe.

    @property
    def listening(self) -> bool:
        return self._listener is not None

    def listen(self) -> bool:
        for directory in runtime_dir_candidates(os.geteuid(), dict(os.environ)):
            if private_dir(directory):
                remove_stale_sockets(directory)
                if self._bind(directory):
                    return True
        # Every usual place is taken: another user may have made our directory
        # first. One of our own, under a name no one can take before us; the
        # agent finds the socket through the sockets the job holds open.
        own = own_private_dir(os.geteuid())
        if own is not None:
            if self._bind(own):
                self._own_dir = own
                return True
            with contextlib.suppress(OSError):
                os.rmdir(own)
        return False

    def _bind(self, directory: str) -> bool:
        path = os.path.join(directory, socket_name(self.pid))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a leftover of an earlier process with this pid
            listener.bind(path)
            os.chmod(path, 0o600)
            listener.listen(4)
        except OSError:
            listener.close()
            return False
        self._listener, self.path = listener, path
        self._thread = threading.Thread(target=self._serve, name="dlprof-probe", daemon=True)
        self._thread.start()
        return True

    def close(self) -> None:
        self._closing = True
        self._end_session()
        pending, self._pending = self._pending, []
        for waiting in pending:
            with contextlib.suppress(OSError):
                waiting.connection.close()
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.close()
        if self.path and os.getpid() == self.pid:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            if self._own_dir is not None:
                with contextlib.suppress(OSError):
                    os.rmdir(self._own_dir)

    def close_at_exit(self) -> None:
        """atexit: let the attached agent read the final totals once more, then close."""
        with contextlib.suppress(Exception):
            self._wait_for_last_read()
        self.close()

    def _wait_for_last_read(self) -> None:
        session = self.session
        if (session is None or os.getpid() != self.pid or self._thread is None
                or not self._thread.is_alive()
                or sum(session.recorder.steps.values()) == self._steps_read):
            return  # no agent, or it has every step already
        reads = self._reads
        deadline = time.monotonic() + min(EXIT_READ_INTERVALS * session.interval,
                                          EXIT_READ_MAX_SECONDS)
        while self._reads == reads and self.session is session and time.monotonic() < deadline:
            time.sleep(0.005)

    def mark_step(self, samples: int | None) -> None:
        session = self.session
        if session is None:
            return
        if samples:
            session.recorder.add_samples(samples)
        session.recorder.step_boundary("manual")

    # The probe thread.

    def _serve(self) -> None:
        # Whatever a client sends or a hook does, the listener lives on: a probe
        # whose thread ended would leave a socket no agent can ever use again.
        while not self._closing and self._listener is not None:
            try:
                self._serve_once()
            except Exception:  # never let the probe thread's death reach the job
                self._count("internal")
                with contextlib.suppress(Exception):
                    self._end_session()
                time.sleep(0.1)  # a fault that repeats must not spin this thread
        with contextlib.suppress(Exception):
            self._end_session()

    def _serve_once(self) -> None:
        listener = self._listener
        assert listener is not None
        session = self.session
        if (session is None and not self.persistent and not self._had_session
                and time.monotonic() - self._started > ORPHAN_SECONDS):
            self.close()  # injected, but the agent never came
            return
        watched = [listener] if session is None else [listener, session.connection]
        timeout = 1.0 if session is None else min(1.0, session.interval)
        if session is None and self.persistent:
            timeout = DORMANT_WAKE_SECONDS  # nothing to do until a connection comes
        if session is not None:
            timeout = min(timeout, session.tracer.tick_seconds or timeout)
        side = self._side
        if side is not None:
            watched.append(side)
        pending = list(self._pending)
        if pending:
            timeout = max(0.0, min(timeout, min(p.deadline for p in pending) - time.monotonic()))
        watched.extend(p.connection for p in pending)
        self._wake_by = time.monotonic() + timeout
        try:
            readable = _readable(watched, timeout)
        except (OSError, ValueError):
            if self._closing:
                return
            raise
        self._forgive_starvation(session)
        if listener in readable:
            self._accept(listener)
        for waiting in pending:
            if waiting.connection in readable or time.monotonic() >= waiting.deadline:
                self._read_pending(waiting)
        session = self.session if session is self.session else None
        if session is not None:
            if session.connection in readable or (
                    time.monotonic() - session.last_message > session.lease_seconds
                    and self._readable_now(session.connection)):
                # The second test: the job may have kept this thread off the GIL past
                # the lease while a request came in. That agent is alive.
                self._receive(session)
            elif time.monotonic() - session.last_message > session.lease_seconds:
                self._end_session()  # the agent is stopped or hung: go dormant
        if side is not None and side is self._side and side in readable:
            self._receive_side(side)
        session = self.session
        if session is not None:
            session.tracer.tick()

    @staticmethod
    def _readable_now(connection: socket.socket) -> bool:
        try:
            return bool(_readable([connection], 0))
        except (OSError, ValueError):
            return False

    def _forgive_starvation(self, session: Session | None) -> None:
        """Time the job kept this thread from running (a long native call holding
        the GIL, a checkpoint save, SIGSTOP) is not the agent's silence: an agent
        that is gone and a probe that could not run look alike from the lease."""
        wake_by = self._wake_by
        if session is None or wake_by is None:
            return
        late = time.monotonic() - wake_by
        if late > STARVED_SECONDS:
            session.last_message += late

    def _accept(self, listener: socket.socket) -> None:
        try:
            connection, _ = listener.accept()
        except OSError:
            return
        try:
            peer_pid, peer_uid = peer_credentials(connection)
            if peer_uid not in (0, os.getuid(), os.geteuid()):
                self._count("refused_peer")
                connection.close()
                return
            connection.setblocking(False)
            if len(self._pending) >= MAX_PENDING:
                oldest = self._pending.pop(0)
                self._count("timeout")
                with contextlib.suppress(OSError):
                    oldest.connection.close()
            self._pending.append(_Pending(connection, peer_pid, peer_uid))
        except Exception:
            self._count("malformed")
            with contextlib.suppress(OSError):
                connection.close()

    def _read_pending(self, waiting: _Pending) -> None:
        """Take what has arrived of a new connection's first frame; once whole,
        it is a handshake, or a request beside the attached agent."""
        message: Frame | None = None
        try:
            # No further than this frame: what follows is the session's to read.
            wanted = bytes_wanted(waiting.received, max_bytes=MAX_REQUEST_BYTES)
            chunk = waiting.connection.recv(min(wanted, 1 << 16))
            if not chunk:
                raise ConnectionClosed
            waiting.received += chunk
            message = take_frame(waiting.received, max_bytes=MAX_REQUEST_BYTES)
        except (BlockingIOError, InterruptedError):
            pass
        except ProtocolError as error:
            self._drop_pending(waiting, error.reason)
            return
        except (ConnectionClosed, OSError):
            self._drop_pending(waiting, "malformed" if waiting.received else None)
            return
        if message is None:
            if time.monotonic() >= waiting.deadline:
                self._drop_pending(waiting, "timeout")
            return
        self._pending.remove(waiting)
        connection = waiting.connection
        connection.settimeout(FRAME_SECONDS)  # replies must not wait on a reader for long
        if self.session is not None:
            self._second_connection(connection, waiting.peer_uid, message, self.session)
        else:
            self._handshake(connection, waiting.peer_pid, waiting.peer_uid, message)

    def _drop_pending(self, waiting: _Pending, reason: str | None) -> None:
        with contextlib.suppress(ValueError):
            self._pending.remove(waiting)
        if reason is not None:
            self._count(reason)
        with contextlib.suppress(OSError):
            waiting.connection.close()

    def _second_connection(self, connection: socket.socket, peer_uid: int,
                           message: Frame, session: Session) -> None:
        """An agent is attached: a trace client may work beside it (handlers.answer_second)."""
        from dlprof_agent.probe import handlers
        reply, beside = handlers.answer_second(session, message, peer_uid,
                                               self._side is not None, self.dropped)
        self._reply(connection, reply)
        if beside:
            self._side = connection
            return
        connection.close()

    def _receive_side(self, connection: socket.socket) -> None:
        from dlprof_agent.probe import handlers
        session = self.session
        try:
            message = read_frame(connection, max_bytes=MAX_REQUEST_BYTES,
                                 seconds=FRAME_SECONDS)
        except (ProtocolError, ConnectionClosed, OSError) as error:
            if isinstance(error, ProtocolError):
                self._count(error.reason)
            self._close_side(cancel=True)
            return
        if session is None:
            handlers.count_refused(message.get("command"), self.dropped)
            self._reply(connection, {"ok": False, "error": "only trace commands here"})
            return
        reply, _ = handlers.answer(session, message, self.dropped, beside=True)
        self._reply(connection, reply)

    def _close_side(self, *, cancel: bool) -> None:
        side, self._side = self._side, None
        if side is None:
            return
        if cancel and self.session is not None:
            self.session.tracer.cancel_capture()
        with contextlib.suppress(OSError):
            side.close()

    def _handshake(self, connection: socket.socket, peer_pid: int, peer_uid: int,
                   message: Frame) -> None:
        from dlprof_agent.probe import handlers
        session, refusal = handlers.open_session(connection, peer_pid, peer_uid, message,
                                                 self.dropped)
        if session is None:
            if refusal is not None:
                self._reply(connection, refusal)
            connection.close()
            return
        connection.settimeout(FRAME_SECONDS)
        _follow_main_thread_cpus()
        self.session = session
        self._had_session = True
        self._reply(connection, handlers.hello(session, self.dropped, pid=self.pid,
                                               persistent=self.persistent))

    def _receive(self, session: Session) -> None:
        from dlprof_agent.probe import handlers
        try:
            message = read_frame(session.connection, max_bytes=MAX_REQUEST_BYTES,
                                 seconds=FRAME_SECONDS)
        except ProtocolError as error:
            # The stream cannot be trusted past a bad frame: drop the connection.
            self._count(error.reason)
            self._end_session()
            return
        except (ConnectionClosed, OSError):
            self._end_session()  # the agent exited or was killed
            return
        session.last_message = time.monotonic()
        steps = sum(session.recorder.steps.values())  # at most what the reply counts
        reply, ends = handlers.answer(session, message, self.dropped)
        self._reply(session.connection, reply)
        if message.get("command") == "snapshot":
            self._steps_read, self._reads = steps, self._reads + 1
        if ends:
            self._end_session()

    def _reply(self, connection: socket.socket, message: Reply) -> None:
        with contextlib.suppress(OSError):
            connection.sendall(encode(message))

    def _end_session(self) -> None:
        self._close_side(cancel=False)
        session, self.session = self.session, None
        if session is None:
            return
        session.remove_hooks()
        session.tracer.stop()
        with contextlib.suppress(OSError):
            session.connection.close()
        if not self.persistent and not self._closing:
            self.close()  # injected: leave nothing listening behind

    def _count(self, reason: str) -> None:
        from dlprof_agent.probe import handlers
        handlers.count(self.dropped, reason)

