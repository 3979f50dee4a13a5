"""The agent's side of the probe channel: finds a probe's socket, checks who
serves it, starts the probe and asks it for snapshots, which
``samples.py`` decodes into typed samples."""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import re
import socket
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from dlprof_agent.collectors.procfs import (
    PROC_ROOT,
    ProcessFiles,
    read_status,
    read_unix_sockets,
    socket_inodes,
)
from dlprof_agent.errors import (
    ConnectionClosed,
    ProbeBusy,
    ProbeImpostor,
    ProbeStale,
    ProbeUnavailable,
    ProtocolError,
    TargetGone,
)
from dlprof_agent.probe.messages import Frame, Request
from dlprof_agent.probe.protocol import (
    HEADER,
    MAX_REPLY_BYTES,
    VERSION,
    bytes_wanted,
    encode,
    peer_credentials,
    read_frame,
    runtime_dir_candidates,
    socket_name,
    take_frame,
)
from dlprof_agent.probe_link.reply_pacing import ReplyPacing
from dlprof_agent.probe_link.samples import ProbeSample
from dlprof_agent.reach.procfs import inside_root_path

REPLY_SECONDS = 2.0  # the probe answers within milliseconds unless its process is stuck


def find_probe_socket(pid: int, *, procfs: str = PROC_ROOT) -> str | None:
    """The first of ``probe_socket_paths``: where the probe of ``pid`` listens,
    unless someone else planted a socket there first."""
    return next(probe_socket_paths(pid, procfs=procfs), None)


def probe_socket_paths(pid: int, *, procfs: str = PROC_ROOT) -> Iterator[str]:
    """The sockets that may be the probe of ``pid``: where that process's user
    and environment would have put it, then (read only if asked for) the probe
    sockets the process itself holds open, wherever they are: a probe whose
    usual directories another user took first makes one of its own. Connecting
    checks which is the probe."""
    files = ProcessFiles(pid, root=procfs)
    try:
        uid = files.owner_uid()
        environ = files.environ() or {}
        status = files.status()
    except TargetGone:
        return
    # In a container the probe names its socket with its own pid, and its /tmp is
    # the container's: look there too, through the process's root.
    innermost = status.nspid[-1] if status is not None and status.nspid else pid
    names = dict.fromkeys((socket_name(pid), socket_name(innermost)))
    usual = [os.path.join(directory, name)
             for directory in runtime_dir_candidates(uid, environ) for name in names]
    given: set[str] = set()
    for path in itertools.chain(usual, _lazy(lambda: held_sockets(pid, set(names), procfs))):
        # As the process sees it: here, or in its container through its root.
        for root in ("", inside_root_path(pid, "", procfs=procfs)):
            if root + path not in given and os.path.exists(root + path):
                given.add(root + path)
                yield root + path
                break


def _lazy(read: Callable[[], list[str]]) -> Iterator[str]:
    yield from read()


def held_sockets(pid: int, names: set[str], procfs: str = PROC_ROOT) -> list[str]:
    """Paths, as ``pid`` sees them, of the Unix sockets named one of ``names``
    that ``pid`` itself holds open: its network namespace lists every bound
    socket with its inode (net/unix), and its descriptors say which are its own.
    A socket planted under the same name by someone else is not among them."""
    listed = {inode: path for inode, path in read_unix_sockets(pid, root=procfs)
              if os.path.basename(path) in names}
    if not listed:
        return []
    held = socket_inodes(pid, root=procfs)
    return [path for inode, path in listed.items() if inode in held]


def _status_ids(pid: int, procfs: str) -> tuple[int, set[int]]:
    """The parent pid and the uids (real, effective, saved, filesystem) of ``pid``.
    Raises TargetGone, or OSError when it may not be read."""
    status = read_status(pid, root=procfs)
    if status is None:
        raise PermissionError(f"cannot read the status of process {pid}")
    return status.ppid, set(status.uids)


def _descends_from(pid: int, ancestor: int, procfs: str) -> bool:
    for _ in range(4096):  # a pid chain is finite; this bounds a racing one
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
        try:
            pid = _status_ids(pid, procfs)[0]
        except (OSError, ValueError, TargetGone):
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
               procfs: str = PROC_ROOT) -> None:
    """The process serving ``connection`` must be ``pid`` or one of its
    descendants, running as the job's user (SO_PEERCRED: the kernel's word, not
    the peer's). Raises ProbeImpostor."""
    peer_pid, peer_uid = peer_credentials(connection)
    if peer_uid not in uids:
        raise ProbeImpostor(f"refused {path}: it is served by uid {peer_uid}, not by the "
                            "job's user", pid=pid)
    if not _descends_from(peer_pid, pid, procfs):
        raise ProbeImpostor(f"refused {path}: it is served by pid {peer_pid}, which is "
                            f"not process {pid} or one of its children", pid=pid)


def target_uids(pid: int, procfs: str = PROC_ROOT) -> set[int]:
    try:
        return _status_ids(pid, procfs)[1]
    except (OSError, ValueError, TargetGone):
        raise ProbeUnavailable(f"process {pid} is gone", pid=pid) from None


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
    answers late, and that is not a lost probe. ``received_bytes``: how much of
    the reply came before the deadline; a reply that has begun but trickles is
    not a job holding the GIL (the probe writes a reply at once)."""

    def __init__(self, message: str, *, received_bytes: int = 0) -> None:
        super().__init__(message)
        self.received_bytes = received_bytes


class ProbeClient:
    """One connection to one probe. Not thread-safe: its channel (channel.py) owns it."""

    def __init__(self, pid: int, connection: socket.socket, hello: Mapping[str, Any],
                 *, layers: bool = True) -> None:
        self.pid = pid
        self._connection = connection
        # The HelloReply as received: only "ok" and "version" are checked (connect),
        # so readers take the rest with .get and a default.
        self.hello = hello
        self.max_series: int | None = None  # the target's series budget: rows past it fold
        self.pacing = ReplyPacing()  # replies larger than a pass's byte budget: decoded less often
        self._dropping = 0  # bytes of a reply still to take off the socket undecoded
        self.layers = layers  # the agent asked for layer times: without, none is kept
        self._received = bytearray()  # a reply's bytes so far, kept across timeouts
        self._awaiting: str | None = None  # the command whose reply has not arrived
        # Reply k answers request k (in order, one at a time): replies_taken past n
        # says the probe answered a request sent after the n-th.
        self.requests_sent = self.replies_taken = 0
        # The whole of one read of a reply, however the probe spreads its bytes: a
        # timeout per recv() would be reset by every byte of a reply that drips.
        self._reply_seconds = connection.gettimeout() or REPLY_SECONDS

    @staticmethod
    def _open(pid: int, path: str, message: Request) -> tuple[socket.socket, Frame]:
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
                             f"({error.strerror})", pid=pid) from None
        except OSError as error:
            connection.close()
            raise ProbeUnavailable(f"its socket {path} did not answer "
                                   f"({error.strerror or type(error).__name__})",
                                   pid=pid) from None
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
            raise ProbeUnavailable(f"its socket {path} did not answer ({why})",
                                   pid=pid) from None
        return connection, reply

    @staticmethod
    def _busy(pid: int, reply: Frame) -> ProbeBusy:
        agent_pid = reply.get("agent_pid")
        return ProbeBusy(agent_pid if isinstance(agent_pid, int) and not isinstance(
            agent_pid, bool) and agent_pid > 0 else None, pid=pid)

    @classmethod
    def connect(cls, pid: int, path: str, options: Mapping[str, object]) -> ProbeClient:
        """Start the probe with ``options`` (StartArgs)."""
        connection, reply = cls._open(pid, path, {"command": "start", "args": options})
        if not reply.get("ok"):
            connection.close()
            if reply.get("error") == "busy":
                raise cls._busy(pid, reply)
            raise ProbeUnavailable(f"it refused to start: {str(reply.get('error'))[:200]}",
                                   pid=pid)
        if reply.get("version") != VERSION:
            connection.close()
            raise ProbeUnavailable(f"it speaks protocol {reply.get('version')!r:.20}, this "
                                   f"agent {VERSION}: use the same dlprof-agent version",
                                   pid=pid)
        return cls(pid, connection, reply, layers=bool(options.get("layers", False)))

    @classmethod
    def connect_beside(cls, pid: int, path: str, message: Request
                       ) -> tuple[ProbeClient, Frame]:
        """A second connection while an agent is attached, whose first frame is
        ``message`` (a probe takes only a ``trace`` that way); with its reply."""
        connection, reply = cls._open(pid, path, message)
        if reply.get("error") == "busy":  # a probe that serves no one beside its agent
            connection.close()
            raise cls._busy(pid, reply)
        return cls(pid, connection, {}), reply

    def set_timeout(self, seconds: float) -> None:
        """How long a reply may take from here on, all of its bytes together."""
        self._reply_seconds = seconds
        self._connection.settimeout(seconds)

    def _reply(self) -> Frame:
        deadline = time.monotonic() + self._reply_seconds
        try:
            while (reply := take_frame(self._received, max_bytes=MAX_REPLY_BYTES)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self._connection.settimeout(left)
                chunk = self._connection.recv(1 << 16)
                if not chunk:
                    raise ConnectionClosed
                self._received += chunk
        except TimeoutError:
            raise ReplyLate(f"no whole reply to {self._awaiting} yet ({len(self._received)} "
                            "bytes of it)", received_bytes=len(self._received)) from None
        finally:
            self._connection.settimeout(self._reply_seconds)
        self._awaiting = None
        self.replies_taken += 1
        return reply

    def request(self, command: str, args: Mapping[str, object] | None = None) -> Frame:
        """The reply to ``command``, unchecked: the caller checks what it reads."""
        if self._awaiting is not None:
            self._reply()  # an earlier request's late reply: this one supersedes it
        message: Request = {"command": command}
        if args is not None:
            message["args"] = args
        self._connection.sendall(encode(message))
        self.requests_sent += 1
        self._awaiting = command
        return self._reply()

    @property
    def idle(self) -> bool:
        """No reply is awaited or being dropped: a request now is answered next."""
        return self._awaiting is None and not self._dropping

    def set_layers(self, layers: bool) -> None:
        """Layer timing on or off in the probe (``configure``), from its next step."""
        reply = self.request("configure", {"layers": layers})
        if not reply.get("ok"):
            raise ProbeUnavailable(f"configure refused: {reply.get('error')!r:.80}",
                                   pid=self.pid)
        self.layers = layers

    def snapshot(self) -> ProbeSample:
        """Raises ReplyLate when the probe has not answered within the timeout; the
        next call then takes that late reply."""
        if self._dropping:
            self._drop_reply()  # the rest of a reply to drop that came late
        held = self.pacing.hold() if self._awaiting is None else None
        if held is not None:
            sample, ask = held
            if ask:
                self._drop_snapshot_reply()
            return sample
        reply = self._reply() if self._awaiting == "snapshot" else self.request("snapshot")
        if not reply.get("ok"):
            raise ProbeUnavailable(f"snapshot refused: {reply.get('error')!r:.80}",
                                   pid=self.pid)
        return self.pacing.decoded(ProbeSample.from_reply(
            self.pid, reply, layers=self.layers, max_series=self.max_series))

    def _drop_snapshot_reply(self) -> None:
        """Ask for a snapshot, which keeps the probe's lease, and take its reply
        off the socket undecoded. Raises ReplyLate as _reply does; the next call
        takes the rest off first."""
        self._connection.sendall(encode({"command": "snapshot"}))
        self.requests_sent += 1
        self._awaiting = "snapshot"
        self._dropping = -1  # until its header says how long it is
        self._drop_reply()

    def _drop_reply(self) -> None:
        """Take the rest of a reply off the socket within one deadline (a
        per-read timeout would let it drip), through one buffer: nothing of it
        is kept."""
        timeout = self._reply_seconds
        deadline = time.monotonic() + timeout
        try:
            if self._dropping < 0:
                while len(self._received) < HEADER.size:
                    self._received += self._recv_by(deadline, HEADER.size - len(self._received))
                frame = HEADER.size + bytes_wanted(bytearray(self._received[:HEADER.size]),
                                                   max_bytes=MAX_REPLY_BYTES)
                taken = min(frame, len(self._received))
                del self._received[:taken]
                self._dropping = frame - taken
            scratch = memoryview(bytearray(1 << 16))
            while self._dropping > 0:
                self._wait_readable(deadline)
                count = self._connection.recv_into(scratch, min(self._dropping, len(scratch)))
                if not count:
                    raise ConnectionClosed
                self._dropping -= count
        except TimeoutError:
            raise ReplyLate(f"no whole reply to {self._awaiting} yet") from None
        finally:
            self._connection.settimeout(timeout)
        self._awaiting = None
        self.replies_taken += 1

    def _wait_readable(self, deadline: float) -> None:
        if (left := deadline - time.monotonic()) <= 0:
            raise TimeoutError
        self._connection.settimeout(left)

    def _recv_by(self, deadline: float, wanted: int) -> bytes:
        self._wait_readable(deadline)
        chunk = self._connection.recv(min(wanted, 1 << 16))
        if not chunk:
            raise ConnectionClosed
        return chunk

    def stop(self) -> None:
        with contextlib.suppress(OSError, ConnectionClosed, ProtocolError):
            self.request("stop")
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._connection.close()
