"""The probe inside the training process: one thread that sleeps on a Unix
socket until an agent connects, then installs the framework hooks and answers
the agent's commands.

Safety outranks everything here. The thread is a daemon, every failure is
caught and counted, and when the agent goes away (closed socket, or silence
longer than the lease) the hooks are removed within one interval. A probe
that was injected also closes its socket then, leaving only imported modules.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import socket
import stat
import struct
import sys
import threading
import time
from typing import Any

from dlprof_agent.errors import ConnectionClosed, ProtocolError
from dlprof_agent.probe.kernel_tracer import KernelTracer
from dlprof_agent.probe.protocol import (
    COMMANDS,
    MAX_REQUEST_BYTES,
    VERSION,
    bytes_wanted,
    encode,
    private_dir,
    read_frame,
    runtime_dir_candidates,
    socket_name,
    take_frame,
)
from dlprof_agent.probe.recorder import (
    DEFAULT_LAYER_BUDGET,
    DEFAULT_MAX_LAYERS,
    DEFAULT_WARMUP_STEPS,
    MAX_SAMPLE_INTERVAL,
    LayerSampling,
    Recorder,
)

HANDSHAKE_SECONDS = 5.0  # a new connection's first frame must arrive whole within this
FRAME_SECONDS = 2.0  # a frame, once begun, must arrive whole within this
MIN_LEASE_SECONDS = 2.0
ORPHAN_SECONDS = 60.0  # an injected probe no agent connects to closes after this
MAX_PENDING = 8  # connections not yet past their first frame; the oldest goes first
# Past this, a wake-up of the probe's thread is late because the job kept it off
# the GIL (or the process was stopped): that time does not count against a lease.
STARVED_SECONDS = 0.25
MAX_TRACE_STEPS = 100_000
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


FRAMEWORK_HOOKS = (("torch", "dlprof_agent.probe.torch_hooks", "TorchHooks"),
                   ("tensorflow", "dlprof_agent.probe.tensorflow_hooks", "TensorFlowHooks"))
# What the hooks use. The probe thread never imports a framework module itself:
# doing so while the main thread is still importing the framework breaks that import.
REQUIRED_MODULES = {
    "torch": ("torch", "torch.nn.modules.module", "torch.optim.optimizer"),
    "tensorflow": ("tensorflow",),
}


def _imported(names: tuple[str, ...]) -> bool:
    """True once every module is in sys.modules and has finished executing."""
    for name in names:
        module = sys.modules.get(name)
        spec = getattr(module, "__spec__", None)
        if module is None or getattr(spec, "_initializing", False):
            return False
    return True


def _readable(sockets: list[socket.socket], timeout: float) -> list[socket.socket]:
    """Those of ``sockets`` with something to read (or a hang-up to see). poll,
    not select: a job with a thousand files open gives descriptors select cannot
    watch."""
    poller = select.poll()
    for each in sockets:
        poller.register(each, select.POLLIN)
    ready = {fd for fd, _ in poller.poll(max(0, int(timeout * 1000)))}
    return [each for each in sockets if each.fileno() in ready]


class _Pending:
    """A connection whose first frame has not arrived whole. It is read as bytes
    come, between the probe's other work: a slow client holds nothing up."""

    def __init__(self, connection: socket.socket, peer_pid: int, peer_uid: int) -> None:
        self.connection = connection
        self.peer_pid = peer_pid
        self.peer_uid = peer_uid
        self.received = bytearray()
        self.deadline = time.monotonic() + HANDSHAKE_SECONDS


class _Session:
    """What an attached agent asked for, and the hooks installed for it."""

    def __init__(self, connection: socket.socket, peer_pid: int, peer_uid: int,
                 options: dict[str, Any]) -> None:
        self.connection = connection
        self.peer_pid = peer_pid
        self.peer_uid = peer_uid
        self.interval = float(options["interval_seconds"])
        self.layers = bool(options["layers"])
        self.recorder = Recorder(warmup_steps=int(options["warmup_steps"]),
                                 max_layers=int(options["max_layers"]))
        self.layer_sampling = (float(options["layers_budget"]), int(options["layers_every"]))
        self.set_layers(self.layers)
        self.hooks: dict[str, Any] = {}
        self.last_message = time.monotonic()
        self.tracer = KernelTracer(continuous=bool(options["kernels"]),
                                   max_layers=int(options["max_layers"]))
        self.tracer.recorder = self.recorder

    @property
    def lease_seconds(self) -> float:
        return max(MIN_LEASE_SECONDS, 3 * self.interval + 1)

    def set_layers(self, layers: bool) -> None:
        self.layers = layers
        budget, every = self.layer_sampling
        self.recorder.layer_sampling = (LayerSampling(budget=budget, every=every)
                                        if layers else None)

    def install_new_hooks(self, errors: dict[str, int]) -> None:
        """Hook each framework once it is imported: with `run`, the agent
        arrives before the script has imported anything."""
        for module_name, hooks_module, class_name in FRAMEWORK_HOOKS:
            if module_name in self.hooks or not _imported(REQUIRED_MODULES[module_name]):
                continue
            try:
                module = __import__(hooks_module, fromlist=[class_name])
                hooks = getattr(module, class_name)(self.recorder, layers=self.layers)
                self.hooks[module_name] = hooks
                if self.layers and hasattr(hooks, "layer_labels"):
                    hooks.kernels = self.tracer  # kernel time per layer, while tracing
                    self.tracer.set_layers(hooks.layer_labels)
                hooks.install()
            except Exception as error:
                errors["install"] = errors.get("install", 0) + 1
                self.recorder.hook_failed(f"install {module_name}", error)

    def remove_hooks(self) -> None:
        hooks, self.hooks = self.hooks, {}
        self.tracer.set_layers(None)
        for installed in hooks.values():
            with contextlib.suppress(Exception):
                installed.remove()

    def start_trace(self, args: Any) -> dict[str, Any]:
        """A windowed trace of the next N steps (command ``trace``)."""
        if not isinstance(args, dict) or set(args) - {"steps", "max_seconds"}:
            raise ValueError("bad trace arguments")
        steps, max_seconds = args.get("steps", 10), args.get("max_seconds", 600)
        if (not isinstance(steps, int) or isinstance(steps, bool)
                or not 1 <= steps <= MAX_TRACE_STEPS):
            raise ValueError("steps out of range")
        if (not isinstance(max_seconds, (int, float)) or isinstance(max_seconds, bool)
                or not 1 <= max_seconds <= 86400):
            raise ValueError("max_seconds out of range")
        error = self.tracer.start_capture(steps, float(max_seconds))
        return {"ok": False, "error": error} if error else {
            "ok": True, "layers": self.layers, "frameworks": sorted(self.hooks)}

    def trace_status(self, args: Any) -> dict[str, Any]:
        offset = args.get("offset", 0) if isinstance(args, dict) else None
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError("bad offset")
        return self.tracer.capture_status(offset)

    def settings(self) -> dict[str, dict[str, str]]:
        result = {}
        for module_name, hooks in self.hooks.items():
            try:
                result[module_name] = hooks.settings()
            except Exception as error:
                self.recorder.hook_failed(f"settings {module_name}", error)
        return result


def _options(args: Any, current: dict[str, Any]) -> dict[str, Any]:
    """Validate command arguments; anything odd raises ValueError."""
    if not isinstance(args, dict):
        raise ValueError("args must be an object")
    merged = dict(current)
    checks = {"interval_seconds": (int, float), "layers": (bool,), "warmup_steps": (int,),
              "max_layers": (int,), "agent_pid": (int,), "kernels": (bool,),
              "layers_budget": (int, float), "layers_every": (int,)}
    for key, value in args.items():
        kinds = checks.get(key)
        # bool is an int in Python; only "layers" and "kernels" may be one.
        if kinds is None or not isinstance(value, kinds) or (
                isinstance(value, bool) and bool not in kinds):
            raise ValueError(f"bad argument {key!r}")
        merged[key] = value
    if not 0.01 <= float(merged["interval_seconds"]) <= 3600:
        raise ValueError("interval_seconds out of range")
    if not 0 <= int(merged["warmup_steps"]) <= 1_000_000:
        raise ValueError("warmup_steps out of range")
    if not 1 <= int(merged["max_layers"]) <= 4096:
        raise ValueError("max_layers out of range")
    if not 0.0001 <= float(merged["layers_budget"]) <= 1:
        raise ValueError("layers_budget out of range")
    if not 0 <= int(merged["layers_every"]) <= MAX_SAMPLE_INTERVAL:
        raise ValueError("layers_every out of range")
    return merged


DEFAULT_OPTIONS: dict[str, Any] = {"interval_seconds": 1.0, "layers": False,
                                   "warmup_steps": DEFAULT_WARMUP_STEPS,
                                   "max_layers": DEFAULT_MAX_LAYERS, "agent_pid": 0,
                                   "kernels": True, "layers_budget": DEFAULT_LAYER_BUDGET,
                                   "layers_every": 0}
# What this probe does beyond the first protocol's commands, told in its hello.
CAPABILITIES = ("kernels", "trace")


class Probe:
    def __init__(self, *, persistent: bool) -> None:
        self.persistent = persistent
        self.pid = os.getpid()
        self.path = ""
        self.dropped: dict[str, int] = {}
        self.session: _Session | None = None
        self._side: socket.socket | None = None  # a trace client beside the agent
        self._pending: list[_Pending] = []
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._started = time.monotonic()
        self._had_session = False
        self._wake_by: float | None = None  # when select should have returned at the latest

    # Start and stop, from whoever enables the probe.

    def listen(self) -> bool:
        for directory in runtime_dir_candidates(os.geteuid(), dict(os.environ)):
            if not private_dir(directory):
                continue
            remove_stale_sockets(directory)
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
                continue
            self._listener, self.path = listener, path
            self._thread = threading.Thread(target=self._serve, name="dlprof-probe",
                                            daemon=True)
            self._thread.start()
            return True
        return False

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

    def _forgive_starvation(self, session: _Session | None) -> None:
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
            peer_pid, peer_uid, _ = _PEERCRED.unpack(connection.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
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
        message: dict[str, Any] | None = None
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
                           message: dict[str, Any], session: _Session) -> None:
        """An agent is attached: a trace client may work beside it; another agent
        hears that the probe is busy (and with whom only when it could see that
        agent's processes anyway: root, or the attached agent's own user)."""
        command = message.get("command")
        if command == "trace" and self._side is None:
            try:
                reply = session.start_trace(message.get("args", {}))
            except ValueError as error:
                self._count("malformed")
                reply = {"ok": False, "error": str(error)}
            self._reply(connection, reply)
            if reply.get("ok"):
                self._side = connection
                return
        elif command == "trace":
            self._reply(connection, {"ok": False, "error": "tracing busy: another trace "
                                                           "client is connected"})
        elif command == "start":
            busy: dict[str, Any] = {"ok": False, "error": "busy"}
            if peer_uid in (0, session.peer_uid):
                busy["agent_pid"] = session.peer_pid
            self._reply(connection, busy)
        else:
            self._count("unknown" if command not in COMMANDS else "malformed")
            self._reply(connection, {"ok": False, "error": "busy"})
        connection.close()

    def _receive_side(self, connection: socket.socket) -> None:
        session = self.session
        try:
            message = read_frame(connection, max_bytes=MAX_REQUEST_BYTES,
                                 seconds=FRAME_SECONDS)
        except (ProtocolError, ConnectionClosed, OSError) as error:
            if isinstance(error, ProtocolError):
                self._count(error.reason)
            self._close_side(cancel=True)
            return
        command = message.get("command")
        if session is None or command not in ("trace_status", "trace"):
            self._count("unknown" if command not in COMMANDS else "malformed")
            self._reply(connection, {"ok": False, "error": "only trace commands here"})
            return
        try:
            reply = (session.trace_status(message.get("args", {})) if command == "trace_status"
                     else session.start_trace(message.get("args", {})))
        except ValueError as error:
            self._count("malformed")
            reply = {"ok": False, "error": str(error)}
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
                   message: dict[str, Any]) -> None:
        if message.get("command") != "start":
            self._count("unknown" if message.get("command") not in COMMANDS else "malformed")
            self._reply(connection, {"ok": False, "error": "say start first"})
            connection.close()
            return
        try:
            options = _options(message.get("args", {}), DEFAULT_OPTIONS)
        except ValueError as error:
            self._count("malformed")
            self._reply(connection, {"ok": False, "error": str(error)})
            connection.close()
            return
        connection.settimeout(FRAME_SECONDS)
        session = _Session(connection, peer_pid, peer_uid, options)
        self.session = session
        self._had_session = True
        session.install_new_hooks(self.dropped)
        self._reply(connection, {"ok": True, "version": VERSION, "pid": self.pid,
                                 "python": sys.version.split()[0],
                                 "persistent": self.persistent,
                                 "frameworks": sorted(session.hooks),
                                 "capabilities": list(CAPABILITIES)})

    def _receive(self, session: _Session) -> None:
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
        command = message.get("command")
        if command == "snapshot":
            session.install_new_hooks(self.dropped)
            session.tracer.tick()
            self._reply(session.connection, {
                "ok": True, "probe": session.recorder.snapshot(),
                "settings": session.settings(), "dropped": dict(self.dropped),
                "kernels": session.tracer.snapshot()})
        elif command == "configure":
            try:
                options = _options(message.get("args", {}), {
                    "interval_seconds": session.interval, "layers": session.layers,
                    "warmup_steps": session.recorder.warmup_steps,
                    "max_layers": session.recorder.max_layers, "agent_pid": 0,
                    "kernels": session.tracer.continuous,
                    "layers_budget": session.layer_sampling[0],
                    "layers_every": session.layer_sampling[1]})
            except ValueError as error:
                self._count("malformed")
                self._reply(session.connection, {"ok": False, "error": str(error)})
                return
            session.interval = float(options["interval_seconds"])
            session.recorder.set_warmup_steps(int(options["warmup_steps"]))
            session.recorder.max_layers = int(options["max_layers"])
            sampling = (float(options["layers_budget"]), int(options["layers_every"]))
            if bool(options["layers"]) != session.layers or sampling != session.layer_sampling:
                session.layer_sampling = sampling
                session.remove_hooks()
                session.set_layers(bool(options["layers"]))
                session.install_new_hooks(self.dropped)
            session.tracer.set_continuous(bool(options["kernels"]))
            self._reply(session.connection, {"ok": True})
        elif command in ("trace", "trace_status"):
            try:
                reply = (session.start_trace(message.get("args", {})) if command == "trace"
                         else session.trace_status(message.get("args", {})))
            except ValueError as error:
                self._count("malformed")
                reply = {"ok": False, "error": str(error)}
            self._reply(session.connection, reply)
        elif command == "stop":
            self._reply(session.connection, {"ok": True})
            self._end_session()
        else:
            self._count("unknown" if command not in COMMANDS else "malformed")
            self._reply(session.connection, {"ok": False, "error": "unknown command"})

    def _reply(self, connection: socket.socket, message: dict[str, Any]) -> None:
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
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


def remove_stale_sockets(directory: str) -> None:
    """Remove probe sockets of processes that no longer exist (a job ended by
    SIGTERM or kill -9 never ran its atexit). Only in our own private directory,
    and only sockets: a pid that is alive, or another user's, is left alone."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if not (name.startswith("probe-") and name.endswith(".sock")):
                continue
            pid_text = name[len("probe-"):-len(".sock")]
            if not pid_text.isdigit() or int(pid_text) == os.getpid():
                continue
            try:
                os.kill(int(pid_text), 0)
                continue  # alive
            except ProcessLookupError:
                pass
            except OSError:
                continue  # alive, someone else's
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                info = os.lstat(path)
                if stat.S_ISSOCK(info.st_mode) and info.st_uid == os.geteuid():
                    os.unlink(path)


_probe: Probe | None = None
_lock = threading.Lock()


def enable(*, persistent: bool = True) -> Probe | None:
    """Start the dormant probe once per process; later calls return it."""
    global _probe  # noqa: PLW0603 - one probe per process
    with _lock:
        if _probe is not None and _probe.pid == os.getpid() and _probe._listener is not None:
            return _probe
        probe = Probe(persistent=persistent)
        if not probe.listen():
            return None
        _probe = probe
        atexit.register(probe.close)
        return probe


def current() -> Probe | None:
    return _probe


def _forget_in_child() -> None:
    # A forked child (a data-loader worker) has no probe thread: drop the hooks it inherited.
    global _probe
    probe, _probe = _probe, None
    if probe is not None:
        session, probe.session = probe.session, None
        if session is not None:
            session.remove_hooks()  # CUPTI is left alone: the parent's, not the child's


os.register_at_fork(after_in_child=_forget_in_child)
