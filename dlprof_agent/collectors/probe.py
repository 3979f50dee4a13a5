"""The agent's side of the probe channel: finds a probe's socket, starts it,
and turns its replies into typed samples once per interval."""

from __future__ import annotations

import contextlib
import glob
import math
import os
import re
import socket
import stat
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from dlprof_agent.errors import (
    ConnectionClosed,
    ProbeBusy,
    ProbeImpostor,
    ProbeStale,
    ProbeUnavailable,
    ProtocolError,
)
from dlprof_agent.probe.protocol import (
    MAX_REPLY_BYTES,
    VERSION,
    encode,
    read_frame,
    runtime_dir_candidates,
    socket_name,
    take_frame,
)

REPLY_SECONDS = 2.0  # the probe answers within milliseconds unless its process is stuck

# What a reply may carry. A real probe stays far inside these (at most max_layers
# names and "other", 200 kernels and "other" per device); anything past them is
# not a probe of ours, and is refused whole rather than exported in part.
MAX_NAME_CHARS = 512  # a layer's dotted path, a kernel's short name, a setting
MAX_LAYER_ROWS = 4096 + 1  # the probe's largest max_layers, and "other"
MAX_KERNEL_ROWS = 64 * 201  # per device: 200 kernels and "other"
MAX_DEVICES = 64
MAX_BUCKETS = 64
MAX_ENTRIES = 64  # the keys of a small map: phases, dropped reasons, settings
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_T = TypeVar("_T")


def _malformed(what: str) -> ProtocolError:
    return ProtocolError("malformed", f"the reply's {what} is not what a probe sends")


def _text(value: Any, what: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _malformed(what)
    text = str(value)
    if len(text) > MAX_NAME_CHARS:
        raise ProtocolError("oversized", f"a {what} of {len(text)} characters")
    return text


def _count(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise _malformed(what)
    return value


def _seconds(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _malformed(what)
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise _malformed(what)
    return seconds


def _list(value: Any, limit: int, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise _malformed(what)
    if len(value) > limit:
        raise ProtocolError("oversized", f"{len(value)} {what}, at most {limit}")
    return value


def _rows(value: Any, limit: int, width: int, what: str) -> list[list[Any]]:
    rows = _list(value, limit, what)
    if not all(isinstance(row, list) and len(row) == width for row in rows):
        raise _malformed(what)
    return rows


def _map(value: Any, what: str, limit: int = MAX_ENTRIES) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _malformed(what)
    if len(value) > limit:
        raise ProtocolError("oversized", f"{len(value)} {what}, at most {limit}")
    return value


def _counts(value: Any, what: str) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((_text(k, what), _count(v, what)) for k, v in _map(value, what).items()))


def _buckets(bounds: Any, counts: Any, what: str
             ) -> tuple[tuple[float, ...], tuple[int, ...]]:
    upper = tuple(_seconds(b, what) for b in _list(bounds, MAX_BUCKETS, what))
    per_bucket = tuple(_count(c, what) for c in _list(counts, MAX_BUCKETS + 1, what))
    if len(per_bucket) != len(upper) + 1 or list(upper) != sorted(upper):
        raise _malformed(what)
    return upper, per_bucket


def parse_reply(parse: Callable[[], _T]) -> _T:
    """``parse()``, with any way a reply can be wrong turned into a ProtocolError:
    the agent's boundary with whatever answers on the socket."""
    try:
        return parse()
    except ProtocolError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, OverflowError
            ) as error:
        raise ProtocolError("malformed", f"unexpected reply ({type(error).__name__})"
                            ) from None


@dataclass(frozen=True, slots=True)
class LayerSample:
    name: str
    forward_seconds: float
    forward_calls: int
    backward_seconds: float
    backward_calls: int


@dataclass(frozen=True, slots=True)
class KernelRow:
    """One kernel (short name, or ``other``) on one CUDA device."""

    kernel: str
    device: int  # CUDA device ordinal, as the job sees it
    launches: int
    seconds: float


@dataclass(frozen=True, slots=True)
class KernelDurations:
    device: int
    bucket_counts: tuple[int, ...]  # per bucket, not cumulative; one more than the bounds
    seconds_sum: float


@dataclass(frozen=True, slots=True)
class MemcpyRow:
    device: int
    kind: str  # h2d, d2h, d2d, p2p, h2h, other
    bytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class LayerGpuRow:
    layer: str
    phase: str  # forward or backward
    seconds: float


@dataclass(frozen=True, slots=True)
class KernelSample:
    """The probe's CUPTI tracer: its state, and totals since the agent attached."""

    state: str  # active, busy or unavailable
    reason: str  # why busy or unavailable; "" when active
    since: float = 0.0  # Unix time the state last changed; 0 from probes that do not say
    kernels: tuple[KernelRow, ...] = ()
    duration_bucket_bounds: tuple[float, ...] = ()  # upper bounds, seconds; +Inf implied
    durations: tuple[KernelDurations, ...] = ()
    memcpy: tuple[MemcpyRow, ...] = ()
    layers: tuple[LayerGpuRow, ...] = ()
    overhead_seconds: float = 0.0
    dropped_records: int = 0
    devices: tuple[tuple[int, str], ...] = ()  # (CUDA ordinal, GPU UUID)
    traced: bool = False  # the tracer has run at some point: its counters are real

    @classmethod
    def from_reply(cls, kernels: dict[str, Any], *, layers: bool = True) -> KernelSample:
        """Raises ProtocolError for anything a probe would not send."""
        return parse_reply(lambda: cls._parse(_map(kernels, "kernels", 32), layers))

    @classmethod
    def _parse(cls, kernels: dict[str, Any], layers: bool) -> KernelSample:
        traced = "kernels" in kernels
        bounds = tuple(_seconds(b, "duration bucket") for b in _list(
            kernels.get("duration_buckets", []), MAX_BUCKETS, "duration buckets"))
        durations = []
        for d, counts, total in _rows(kernels.get("durations", []), MAX_DEVICES, 3,
                                      "kernel durations"):
            _, per_bucket = _buckets(list(bounds), counts, "kernel duration buckets")
            durations.append(KernelDurations(_count(d, "device"), per_bucket,
                                             _seconds(total, "kernel seconds")))
        devices = _map(kernels.get("devices", {}), "devices", MAX_DEVICES)
        layer_rows = _rows(kernels.get("layers", []), 2 * MAX_LAYER_ROWS, 3, "layer GPU rows")
        return cls(
            state=_text(kernels["state"], "kernel state"),
            reason=_text(kernels.get("reason", ""), "kernel state reason"),
            since=_seconds(kernels.get("since", 0.0), "state since"),
            kernels=tuple(KernelRow(_text(k, "kernel name"), _count(d, "device"),
                                    _count(n, "launches"), _seconds(t, "kernel seconds"))
                          for k, d, n, t in _rows(kernels.get("kernels", []),
                                                  MAX_KERNEL_ROWS, 4, "kernel rows")),
            duration_bucket_bounds=bounds,
            durations=tuple(durations),
            memcpy=tuple(MemcpyRow(_count(d, "device"), _text(k, "copy kind"),
                                   _count(b, "bytes"), _seconds(t, "copy seconds"))
                         for d, k, b, t in _rows(kernels.get("memcpy", []),
                                                 MAX_DEVICES * 8, 4, "copy rows")),
            layers=tuple(LayerGpuRow(_text(n, "layer name"), _text(p, "phase"),
                                     _seconds(t, "layer GPU seconds"))
                         for n, p, t in layer_rows) if layers else (),
            overhead_seconds=_seconds(kernels.get("overhead_seconds", 0.0), "overhead"),
            dropped_records=_count(kernels.get("dropped_records", 0), "dropped records"),
            devices=tuple(sorted((int(_text(d, "device")), _text(u, "GPU UUID"))
                                 for d, u in devices.items())),
            traced=traced)


@dataclass(frozen=True, slots=True)
class ProbeSample:
    """Totals since the probe was started by this agent."""

    pid: int
    step_source: str
    steps: tuple[tuple[str, int], ...]  # (phase, count), phase warmup or steady
    samples: tuple[tuple[str, int], ...]
    step_bucket_bounds: tuple[float, ...]  # upper bounds, seconds; +Inf implied
    step_bucket_counts: tuple[int, ...]  # per bucket, not cumulative; one more than bounds
    step_seconds_sum: float
    last_step_seconds: float | None
    phase_seconds: tuple[tuple[str, float], ...]
    layers: tuple[LayerSample, ...]
    hook_errors: int
    dropped_messages: tuple[tuple[str, int], ...]  # (reason, count)
    settings: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]  # per framework
    kernels: KernelSample | None = None  # None: a probe older than kernel tracing
    layer_sampled_steps: int | None = None  # steps whose layers were timed; None: not told

    @property
    def steady_steps(self) -> int:
        return dict(self.steps).get("steady", 0)

    @property
    def steady_samples(self) -> int:
        return dict(self.samples).get("steady", 0)

    @classmethod
    def from_reply(cls, pid: int, reply: dict[str, Any], *, layers: bool = True
                   ) -> ProbeSample:
        """Raises ProtocolError for anything a probe would not send. Without
        ``layers`` (the agent did not ask for them), layer rows are dropped."""
        return parse_reply(lambda: cls._parse(pid, reply, layers))

    @classmethod
    def _parse(cls, pid: int, reply: dict[str, Any], layers: bool) -> ProbeSample:
        probe = _map(reply["probe"], "probe", 32)
        bounds, counts = _buckets(probe["step_buckets"], probe["step_bucket_counts"],
                                  "step buckets")
        last = probe["last_step_seconds"]
        settings = _map(reply.get("settings", {}), "settings", 8)
        kernels = reply.get("kernels")
        # Checked whether asked for or not: a probe not asked for layers sends none.
        layer_rows = _rows(probe["layers"], MAX_LAYER_ROWS, 5, "layers")
        return cls(
            pid=pid,
            step_source=_text(probe["step_source"], "step source"),
            steps=_counts(probe["steps"], "steps"),
            samples=_counts(probe["samples"], "samples"),
            step_bucket_bounds=bounds,
            step_bucket_counts=counts,
            step_seconds_sum=_seconds(probe["step_seconds_sum"], "step seconds"),
            last_step_seconds=None if last is None else _seconds(last, "last step"),
            phase_seconds=tuple(sorted((_text(k, "phase"), _seconds(v, "phase seconds"))
                                       for k, v in _map(probe["phase_seconds"],
                                                        "phases").items())),
            layers=tuple(LayerSample(_text(n, "layer name"), _seconds(fs, "layer seconds"),
                                     _count(fc, "layer calls"), _seconds(bs, "layer seconds"),
                                     _count(bc, "layer calls"))
                         for n, fs, fc, bs, bc in layer_rows) if layers else (),
            layer_sampled_steps=(_count(probe["layer_sampled_steps"], "layer sampled steps")
                                 if "layer_sampled_steps" in probe else None),
            hook_errors=_count(probe["hook_errors"], "hook errors"),
            dropped_messages=_counts(reply.get("dropped", {}), "dropped messages"),
            settings=tuple(sorted(
                (_text(framework, "framework"),
                 tuple(sorted((_text(k, "setting"), _text(v, "setting"))
                              for k, v in _map(values, "settings").items())))
                for framework, values in settings.items())),
            kernels=(KernelSample._parse(_map(kernels, "kernels", 32), layers)
                     if isinstance(kernels, dict) else None),
        )


def find_probe_socket(pid: int, *, procfs: str = "/proc") -> str | None:
    """The socket of the probe in ``pid``, looked up where that process's user
    and environment would have put it."""
    try:
        uid = os.stat(f"{procfs}/{pid}").st_uid
    except OSError:
        return None
    environ: dict[str, str] = {}
    with contextlib.suppress(OSError), open(f"{procfs}/{pid}/environ", "rb") as file:
        for entry in file.read().split(b"\0"):
            key, _, value = entry.partition(b"=")
            environ[key.decode(errors="replace")] = value.decode(errors="replace")
    # In a container the probe names its socket with its own pid, and its /tmp is
    # the container's: look there too, through the process's root.
    names = dict.fromkeys((socket_name(pid), socket_name(_innermost_pid(pid, procfs))))
    for directory in runtime_dir_candidates(uid, environ):
        for root in ("", f"{procfs}/{pid}/root"):
            for name in names:
                path = root + os.path.join(directory, name)
                if os.path.exists(path):
                    return path
    return None


def _innermost_pid(pid: int, procfs: str) -> int:
    """``pid`` as the process itself sees it, in its own pid namespace."""
    with contextlib.suppress(OSError, ValueError), open(f"{procfs}/{pid}/status") as file:
        for line in file:
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    return pid


def _status_ids(pid: int, procfs: str) -> tuple[int, set[int]]:
    """The parent pid and the uids (real, effective, saved, filesystem) of ``pid``."""
    parent, uids = 0, set()
    with open(f"{procfs}/{pid}/status") as file:
        for line in file:
            if line.startswith("PPid:"):
                parent = int(line.split()[1])
            elif line.startswith("Uid:"):
                uids = {int(uid) for uid in line.split()[1:]}
    return parent, uids


def _descends_from(pid: int, ancestor: int, procfs: str) -> bool:
    for _ in range(4096):  # a pid chain is finite; this bounds a racing one
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        try:
            pid = _status_ids(pid, procfs)[0]
        except (OSError, ValueError):
            return False
    return False


def check_socket_place(path: str, uids: set[int]) -> None:
    """Refuse a socket in a directory another user owns or may write into, or a
    socket another user owns: someone could have planted it there for the job.
    Raises ProbeImpostor."""
    directory = os.path.dirname(path)
    try:
        folder, node = os.lstat(directory), os.lstat(path)
    except OSError as error:
        raise ProbeStale(f"its socket {path} is gone ({error.strerror})") from None
    owners = uids | {0}
    if not stat.S_ISDIR(folder.st_mode) or folder.st_uid not in owners:
        raise ProbeImpostor(f"refused {path}: its directory belongs to uid {folder.st_uid}, "
                            "not to the job's user")
    if folder.st_mode & 0o022:
        raise ProbeImpostor(f"refused {path}: its directory is writable by other users "
                            f"(mode {stat.S_IMODE(folder.st_mode):o})")
    if not stat.S_ISSOCK(node.st_mode) or node.st_uid not in owners:
        raise ProbeImpostor(f"refused {path}: not a socket of the job's user "
                            f"(uid {node.st_uid})")


def check_peer(connection: socket.socket, pid: int, uids: set[int], path: str,
               procfs: str = "/proc") -> None:
    """The process serving ``connection`` must be ``pid`` or one of its
    descendants, running as the job's user (SO_PEERCRED: the kernel's word, not
    the peer's). Raises ProbeImpostor."""
    peer_pid, peer_uid, _ = _PEERCRED.unpack(connection.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    if peer_uid not in uids:
        raise ProbeImpostor(f"refused {path}: it is served by uid {peer_uid}, not by the "
                            "job's user")
    if not _descends_from(peer_pid, pid, procfs):
        raise ProbeImpostor(f"refused {path}: it is served by pid {peer_pid}, which is "
                            f"not process {pid} or one of its children")


def target_uids(pid: int, procfs: str = "/proc") -> set[int]:
    try:
        return _status_ids(pid, procfs)[1]
    except (OSError, ValueError):
        raise ProbeUnavailable(f"process {pid} is gone") from None


PROBE_SOCKET = re.compile(r"probe-(\d+)\.sock")


def probe_socket_pids(directories: Iterable[str]) -> set[int]:
    """Pids with a probe socket in ``directories`` (glob patterns allowed): how a
    node daemon finds jobs that loaded the probe, without reading every
    process's environment. A pid may be stale; connecting tells."""
    pids = set()
    for pattern in directories:
        for directory in glob.glob(pattern):
            with contextlib.suppress(OSError):
                for name in os.listdir(directory):
                    if match := PROBE_SOCKET.fullmatch(name):
                        pids.add(int(match.group(1)))
    return pids


class ReplyLate(TimeoutError):
    """The probe has not answered yet. Its reply is still expected, and the next
    call reads it first: a job holding the GIL (an import, a long native call)
    answers late, and that is not a lost probe."""


class ProbeClient:
    """One connection to one probe. Not thread-safe: the sampler owns it."""

    def __init__(self, pid: int, connection: socket.socket, hello: dict[str, Any],
                 *, layers: bool = True) -> None:
        self.pid = pid
        self._connection = connection
        self.hello = hello
        self.layers = layers  # the agent asked for layer times: without, none is kept
        self._received = bytearray()  # a reply's bytes so far, kept across timeouts
        self._awaiting: str | None = None  # the command whose reply has not arrived

    @staticmethod
    def _open(pid: int, path: str, message: dict[str, Any]) -> tuple[socket.socket,
                                                                     dict[str, Any]]:
        """Connect to the probe of ``pid`` at ``path``, check that it is that
        process's, send ``message`` and read the reply."""
        uids = target_uids(pid)
        check_socket_place(path, uids)
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.settimeout(REPLY_SECONDS)
        try:
            connection.connect(path)
        except (ConnectionRefusedError, FileNotFoundError) as error:
            connection.close()
            raise ProbeStale(f"nothing listens on its socket {path} "
                             f"({error.strerror})") from None
        except OSError as error:
            connection.close()
            raise ProbeUnavailable(f"its socket {path} did not answer "
                                   f"({error.strerror or type(error).__name__})") from None
        try:
            check_peer(connection, pid, uids, path)
            # A busy probe answers and hangs up without reading: its reply still waits
            # in our receive queue, so a failed send is no reason not to read it.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                connection.sendall(encode(message))
            reply = read_frame(connection, max_bytes=MAX_REPLY_BYTES, seconds=REPLY_SECONDS)
        except ProbeUnavailable:
            connection.close()
            raise
        except (OSError, ConnectionClosed, ProtocolError) as error:
            connection.close()
            why = str(error) or type(error).__name__
            raise ProbeUnavailable(f"its socket {path} did not answer ({why})") from None
        return connection, reply

    @staticmethod
    def _busy(reply: dict[str, Any]) -> ProbeBusy:
        agent_pid = reply.get("agent_pid")
        return ProbeBusy(agent_pid if isinstance(agent_pid, int) and not isinstance(
            agent_pid, bool) and agent_pid > 0 else None)

    @classmethod
    def connect(cls, pid: int, path: str, options: dict[str, Any]) -> ProbeClient:
        connection, reply = cls._open(pid, path, {"command": "start", "args": options})
        if not reply.get("ok"):
            connection.close()
            if reply.get("error") == "busy":
                raise cls._busy(reply)
            raise ProbeUnavailable(f"it refused to start: {str(reply.get('error'))[:200]}")
        if reply.get("version") != VERSION:
            connection.close()
            raise ProbeUnavailable(f"it speaks protocol {reply.get('version')!r:.20}, this "
                                   f"agent {VERSION}: use the same dlprof-agent version")
        return cls(pid, connection, reply, layers=bool(options.get("layers", False)))

    @classmethod
    def connect_beside(cls, pid: int, path: str, message: dict[str, Any]
                       ) -> tuple[ProbeClient, dict[str, Any]]:
        """A second connection while an agent is attached, whose first frame is
        ``message`` (a probe takes only a ``trace`` that way); with its reply."""
        connection, reply = cls._open(pid, path, message)
        if reply.get("error") == "busy":  # a probe that serves no one beside its agent
            connection.close()
            raise cls._busy(reply)
        return cls(pid, connection, {}), reply

    def set_timeout(self, seconds: float) -> None:
        """How long a reply may take from here on."""
        self._connection.settimeout(seconds)

    def _reply(self) -> dict[str, Any]:
        while (reply := take_frame(self._received, max_bytes=MAX_REPLY_BYTES)) is None:
            try:
                chunk = self._connection.recv(1 << 16)
            except TimeoutError:
                raise ReplyLate(f"no reply to {self._awaiting} yet") from None
            if not chunk:
                raise ConnectionClosed
            self._received += chunk
        self._awaiting = None
        return reply

    def request(self, command: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        if self._awaiting is not None:
            self._reply()  # an earlier request's late reply: this one supersedes it
        message: dict[str, Any] = {"command": command}
        if args is not None:
            message["args"] = args
        self._connection.sendall(encode(message))
        self._awaiting = command
        return self._reply()

    def snapshot(self) -> ProbeSample:
        """Raises ReplyLate when the probe has not answered within the timeout; the
        next call then takes that late reply."""
        reply = self._reply() if self._awaiting == "snapshot" else self.request("snapshot")
        if not reply.get("ok"):
            raise ProbeUnavailable(f"snapshot refused: {reply.get('error')!r:.80}")
        return ProbeSample.from_reply(self.pid, reply, layers=self.layers)

    def stop(self) -> None:
        with contextlib.suppress(OSError, ConnectionClosed, ProtocolError):
            self.request("stop")
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._connection.close()
