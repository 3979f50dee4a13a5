"""The agent's side of the probe channel: finds a probe's socket, starts it,
and turns its replies into typed samples once per interval."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dlprof_agent.probe.protocol import (
    MAX_REPLY_BYTES,
    VERSION,
    ConnectionClosed,
    ProtocolError,
    encode,
    read_frame,
    runtime_dir_candidates,
    socket_name,
    take_frame,
)

REPLY_SECONDS = 2.0  # the probe answers within milliseconds unless its process is stuck


class ProbeUnavailable(Exception):
    """No probe answers for this process; the message says why, in plain words."""


class ProbeBusy(ProbeUnavailable):
    def __init__(self, agent_pid: int) -> None:
        super().__init__(f"another agent (pid {agent_pid}) is attached")
        self.agent_pid = agent_pid


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
    def from_reply(cls, kernels: dict[str, Any]) -> KernelSample:
        traced = "kernels" in kernels
        return cls(
            state=str(kernels["state"]), reason=str(kernels.get("reason", "")),
            since=float(kernels.get("since", 0.0)),
            kernels=tuple(KernelRow(str(k), int(d), int(n), float(s))
                          for k, d, n, s in kernels.get("kernels", [])),
            duration_bucket_bounds=tuple(float(b) for b in kernels.get("duration_buckets", [])),
            durations=tuple(KernelDurations(int(d), tuple(int(c) for c in counts), float(s))
                            for d, counts, s in kernels.get("durations", [])),
            memcpy=tuple(MemcpyRow(int(d), str(k), int(b), float(s))
                         for d, k, b, s in kernels.get("memcpy", [])),
            layers=tuple(LayerGpuRow(str(n), str(p), float(s))
                         for n, p, s in kernels.get("layers", [])),
            overhead_seconds=float(kernels.get("overhead_seconds", 0.0)),
            dropped_records=int(kernels.get("dropped_records", 0)),
            devices=tuple(sorted((int(d), str(u)) for d, u in kernels.get("devices", {}).items())),
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
    def from_reply(cls, pid: int, reply: dict[str, Any]) -> ProbeSample:
        probe = reply["probe"]
        return cls(
            pid=pid,
            step_source=str(probe["step_source"]),
            steps=tuple(sorted((str(k), int(v)) for k, v in probe["steps"].items())),
            samples=tuple(sorted((str(k), int(v)) for k, v in probe["samples"].items())),
            step_bucket_bounds=tuple(float(b) for b in probe["step_buckets"]),
            step_bucket_counts=tuple(int(c) for c in probe["step_bucket_counts"]),
            step_seconds_sum=float(probe["step_seconds_sum"]),
            last_step_seconds=(None if probe["last_step_seconds"] is None
                               else float(probe["last_step_seconds"])),
            phase_seconds=tuple(sorted((str(k), float(v))
                                       for k, v in probe["phase_seconds"].items())),
            layers=tuple(LayerSample(str(n), float(fs), int(fc), float(bs), int(bc))
                         for n, fs, fc, bs, bc in probe["layers"]),
            layer_sampled_steps=(int(probe["layer_sampled_steps"])
                                 if "layer_sampled_steps" in probe else None),
            hook_errors=int(probe["hook_errors"]),
            dropped_messages=tuple(sorted((str(k), int(v))
                                          for k, v in reply.get("dropped", {}).items())),
            settings=tuple(sorted(
                (str(framework), tuple(sorted((str(k), str(v)) for k, v in values.items())))
                for framework, values in reply.get("settings", {}).items())),
            kernels=(KernelSample.from_reply(reply["kernels"])
                     if isinstance(reply.get("kernels"), dict) else None),
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

    def __init__(self, pid: int, connection: socket.socket, hello: dict[str, Any]) -> None:
        self.pid = pid
        self._connection = connection
        self.hello = hello
        self._received = bytearray()  # a reply's bytes so far, kept across timeouts
        self._awaiting: str | None = None  # the command whose reply has not arrived

    @classmethod
    def connect(cls, pid: int, path: str, options: dict[str, Any]) -> ProbeClient:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.settimeout(REPLY_SECONDS)
        try:
            connection.connect(path)
            # A busy probe answers and hangs up without reading: its reply still waits
            # in our receive queue, so a failed send is no reason not to read it.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                connection.sendall(encode({"command": "start", "args": options}))
            reply = read_frame(connection, max_bytes=MAX_REPLY_BYTES)
        except (OSError, ConnectionClosed, ProtocolError) as error:
            connection.close()
            why = str(error) or type(error).__name__
            raise ProbeUnavailable(f"its socket {path} did not answer ({why})") from None
        if not reply.get("ok"):
            connection.close()
            if reply.get("error") == "busy":
                raise ProbeBusy(int(reply.get("agent_pid", 0)))
            raise ProbeUnavailable(f"it refused to start: {reply.get('error')}")
        if reply.get("version") != VERSION:
            connection.close()
            raise ProbeUnavailable(f"it speaks protocol {reply.get('version')}, this agent "
                                   f"{VERSION}: use the same dlprof-agent version")
        return cls(pid, connection, reply)

    @classmethod
    def connect_beside(cls, pid: int, path: str, message: dict[str, Any]
                       ) -> tuple[ProbeClient, dict[str, Any]]:
        """A second connection while an agent is attached, whose first frame is
        ``message`` (a probe takes only a ``trace`` that way); with its reply."""
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.settimeout(REPLY_SECONDS)
        try:
            connection.connect(path)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                connection.sendall(encode(message))
            reply = read_frame(connection, max_bytes=MAX_REPLY_BYTES)
        except (OSError, ConnectionClosed, ProtocolError) as error:
            connection.close()
            why = str(error) or type(error).__name__
            raise ProbeUnavailable(f"its socket {path} did not answer ({why})") from None
        if reply.get("error") == "busy":  # a probe that serves no one beside its agent
            connection.close()
            raise ProbeBusy(int(reply.get("agent_pid", 0)))
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
            raise ProbeUnavailable(f"snapshot refused: {reply.get('error')}")
        return ProbeSample.from_reply(self.pid, reply)

    def stop(self) -> None:
        with contextlib.suppress(OSError, ConnectionClosed, ProtocolError):
            self.request("stop")
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._connection.close()
