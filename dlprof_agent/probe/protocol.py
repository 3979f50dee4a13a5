"""The probe's control channel: framed, versioned JSON over a Unix socket.

A frame is a fixed header (magic, version, payload length) and a JSON object.
Commands form a fixed set; nothing received is ever executed. The standard
library only: this module loads inside the training process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import stat
import struct
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from dlprof_agent.errors import ConnectionClosed, ProtocolError

if TYPE_CHECKING:
    from dlprof_agent.probe.messages import Frame

MAGIC = b"DLPR"
VERSION = 1
HEADER = struct.Struct("!4sB3xI")  # magic, version, padding, payload length
_PEERCRED = struct.Struct("3i")  # the kernel's struct ucred: pid, uid, gid
MAX_REQUEST_BYTES = 64 * 1024  # agent -> probe: commands are small
MAX_REPLY_BYTES = 4 * 1024 * 1024  # probe -> agent: 512 layers fit many times over
# "trace" and "trace_status" came later: an older probe answers them "unknown
# command", and the snapshot reply's "kernels" is absent; the frame is unchanged.
COMMANDS = ("start", "stop", "configure", "snapshot", "trace", "trace_status")
SOCKET_DIR_ENV = "DLPROF_AGENT_RUNTIME_DIR"
# The shape a frame may have, checked before json.loads sees it: the parser
# recurses once per level (a deep frame raises RecursionError, in the probe's
# thread), and memory grows with the number of values, not only the bytes.
MAX_DEPTH = 16  # the deepest real frame nests 4 levels
MAX_REQUEST_VALUES = 1_000
MAX_REPLY_VALUES = 200_000  # 512 layers, 16 devices of 201 kernels: a tenth of this
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_INNERMOST = re.compile(rb"\[[^][{}]*\]|\{[^][{}]*\}")  # a pair with no pair inside


def encode(message: Mapping[str, object]) -> bytes:
    """A frame holding ``message`` (one of messages.py's requests or replies)."""
    payload = json.dumps(message, separators=(",", ":")).encode()
    return HEADER.pack(MAGIC, VERSION, len(payload)) + payload


def _read_exact(sock: socket.socket, size: int, deadline: float | None) -> bytes:
    chunks = []
    while size:
        if deadline is not None:
            # Past the deadline, still take what has already arrived: the time may
            # have gone to the job holding the GIL, not to a slow peer.
            sock.settimeout(max(0.0, deadline - time.monotonic()))
        try:
            chunk = sock.recv(min(size, 1 << 16))
        except BlockingIOError:  # past the deadline, and nothing more is there
            raise TimeoutError("the frame did not arrive in time") from None
        if not chunk:
            raise ConnectionClosed
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def peer_credentials(connection: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a Unix socket, as the
    kernel saw them when it connected (SO_PEERCRED), not as the peer says."""
    pid, uid, _ = _PEERCRED.unpack(connection.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


def _payload_length(header: bytes, max_bytes: int) -> int:
    magic, version, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError("malformed", "not a dlprof-agent frame")
    if version != VERSION:
        raise ProtocolError("version", f"protocol version {version}, expected {VERSION}")
    if length > max_bytes:
        raise ProtocolError("oversized", f"{length} bytes, limit {max_bytes}")
    return int(length)


def blank_strings(payload: bytes) -> bytes:
    """``payload`` with every string's content taken out. Without a backslash a
    string is whatever lies between two quotes, and splitting on them is several
    times faster than the pattern on a reply of long names."""
    if b"\\" not in payload:
        parts = payload.split(b'"')
        if len(parts) % 2:  # every string closed
            return b'""'.join(parts[::2])
    return _STRING.sub(b'""', payload)


def check_shape(payload: bytes, *, max_values: int, max_depth: int = MAX_DEPTH) -> None:
    """Refuse a payload nested deeper than ``max_depth`` or holding more than
    ``max_values`` values, before any parser sees it. Strings are blanked first,
    so brackets and commas inside them do not count."""
    skeleton = blank_strings(payload)
    containers = skeleton.count(b"[") + skeleton.count(b"{")
    if containers + skeleton.count(b",") + skeleton.count(b":") > max_values:
        raise ProtocolError("oversized", f"more than {max_values} values")
    # Each pass takes away the innermost level of every pair: what is left after
    # max_depth passes is nested deeper than that, or does not pair up.
    brackets = skeleton.translate(None, _NOT_BRACKETS)
    for _ in range(max_depth):
        if not brackets:
            return
        brackets, removed = _INNERMOST.subn(b"", brackets)
        if not removed:
            break
    if brackets:
        raise ProtocolError("malformed", f"nested deeper than {max_depth} levels, "
                                         "or brackets that do not pair up")


def _decode(payload: bytes, max_values: int) -> Frame:
    check_shape(payload, max_values=max_values)
    try:
        message = json.loads(payload)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ProtocolError("malformed", str(error)) from None
    if not isinstance(message, dict):
        raise ProtocolError("malformed", "a frame must hold a JSON object")
    return message


def _max_values(max_bytes: int) -> int:
    return MAX_REQUEST_VALUES if max_bytes <= MAX_REQUEST_BYTES else MAX_REPLY_VALUES


def read_frame(sock: socket.socket, *, max_bytes: int, seconds: float | None = None
               ) -> Frame:
    """One frame; the whole of it within ``seconds`` (TimeoutError otherwise),
    however the peer spreads its bytes, or as the socket's timeout has it per
    read when None."""
    if seconds is None:
        length = _payload_length(_read_exact(sock, HEADER.size, None), max_bytes)
        return _decode(_read_exact(sock, length, None), _max_values(max_bytes))
    deadline, timeout = time.monotonic() + seconds, sock.gettimeout()
    try:
        length = _payload_length(_read_exact(sock, HEADER.size, deadline), max_bytes)
        payload = _read_exact(sock, length, deadline)
    finally:
        sock.settimeout(timeout)  # the reply is written under the socket's own timeout
    return _decode(payload, _max_values(max_bytes))


def bytes_wanted(received: bytearray, *, max_bytes: int) -> int:
    """How many more bytes the first frame in ``received`` needs: a reader that
    takes no more than that leaves what follows it on the socket."""
    if len(received) < HEADER.size:
        return HEADER.size - len(received)
    end = HEADER.size + _payload_length(bytes(received[:HEADER.size]), max_bytes)
    return max(0, end - len(received))


def take_frame(received: bytearray, *, max_bytes: int) -> Frame | None:
    """The first whole frame in ``received``, removed from it; None until all of
    it has arrived. For readers that must not lose a frame to a timeout."""
    if len(received) < HEADER.size:
        return None
    end = HEADER.size + _payload_length(bytes(received[:HEADER.size]), max_bytes)
    if len(received) < end:
        return None
    with memoryview(received) as view:  # one copy of the payload, not two
        payload = bytes(view[HEADER.size:end])
    del received[:end]
    return _decode(payload, _max_values(max_bytes))


def runtime_dir_candidates(uid: int, environ: dict[str, str]) -> list[str]:
    """Where a probe of user ``uid`` puts its socket, most specific first."""
    candidates = []
    if environ.get(SOCKET_DIR_ENV):
        candidates.append(environ[SOCKET_DIR_ENV])
    if environ.get("XDG_RUNTIME_DIR"):
        candidates.append(os.path.join(environ["XDG_RUNTIME_DIR"], "dlprof-agent"))
    candidates.append(f"/tmp/dlprof-agent-{uid}")
    return candidates


OWN_DIR_PARENTS = ("/tmp",)  # under the daemon's search pattern for probe sockets


def own_private_dir(uid: int) -> str | None:
    """A new directory of our own, 0700, under a name no one could have made
    before us (mkdtemp); None if none can be made."""
    import tempfile  # only when the usual places are taken

    for parent in dict.fromkeys((*OWN_DIR_PARENTS, tempfile.gettempdir())):
        try:
            return tempfile.mkdtemp(prefix=f"dlprof-agent-{uid}-", dir=parent)
        except OSError:
            continue
    return None


def socket_name(pid: int) -> str:
    return f"probe-{pid}.sock"


def private_dir(path: str) -> bool:
    """Create ``path`` as 0700, or accept it if it exists, is ours and private."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return False
    try:
        info = os.lstat(path)
    except OSError:
        return False
    # Refuse a directory someone else planted, or one others can write into.
    return (stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
            and not info.st_mode & 0o022)


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
