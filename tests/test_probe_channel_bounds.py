"""What the probe's decoder and the agent's reader of replies take from a peer
they cannot trust: any bytes, lengths and nesting give a frame, or a
ProtocolError, and nothing else; memory stays within a bound of the frame's
size; a reply's content is typed and capped before it becomes series."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import textwrap
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlprof_agent.errors import ProtocolError
from dlprof_agent.probe.protocol import (
    HEADER,
    MAGIC,
    MAX_DEPTH,
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    VERSION,
    encode,
    read_frame,
    take_frame,
)
from dlprof_agent.probe.recorder import Recorder
from dlprof_agent.probe_link.samples import MAX_LAYER_ROWS, ProbeSample

QUICK = settings(max_examples=150, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def frame(payload: bytes, *, length: int | None = None, version: int = VERSION) -> bytes:
    return HEADER.pack(MAGIC, version, len(payload) if length is None else length) + payload


def nested(depth: int, inner: bytes = b"1") -> bytes:
    return b'{"command":' + b"[" * depth + inner + b"]" * depth + b"}"


def take_all(data: bytes, max_bytes: int) -> list[dict[str, Any]]:
    """Frames taken from ``data`` as the agent's reader takes them: a ProtocolError
    ends the stream (the reader drops the connection)."""
    received, frames = bytearray(), []
    for start in range(0, len(data), 4096):
        received += data[start:start + 4096]
        while (message := take_frame(received, max_bytes=max_bytes)) is not None:
            frames.append(message)
    return frames


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=40)


@QUICK
@given(st.binary(max_size=2048))
def test_any_bytes_give_frames_or_a_protocol_error(data: bytes) -> None:
    for max_bytes in (MAX_REQUEST_BYTES, MAX_REPLY_BYTES):
        with contextlib.suppress(ProtocolError):
            take_all(data, max_bytes)


@QUICK
@given(st.binary(max_size=512), st.integers(0, 2**32 - 1), st.integers(0, 255))
def test_any_header_and_payload_give_a_frame_or_a_protocol_error(
        payload: bytes, length: int, version: int) -> None:
    data = frame(payload, length=length, version=version)
    with contextlib.suppress(ProtocolError):
        take_all(data, MAX_REQUEST_BYTES)


@QUICK
@given(st.integers(1, 60_000), st.sampled_from([b"[", b"{\"a\":"]),
       st.sampled_from([b"", b"1", b'"]]]"', b"[", b"]"]))
def test_any_nesting_gives_a_frame_or_a_protocol_error(depth: int, opener: bytes,
                                                       inner: bytes) -> None:
    closer = b"]" if opener == b"[" else b"}"
    payload = opener * depth + inner + closer * depth
    if len(payload) > MAX_REQUEST_BYTES:
        payload = payload[:MAX_REQUEST_BYTES]
    try:
        take_all(frame(payload), MAX_REQUEST_BYTES)
    except ProtocolError as error:
        assert error.reason in ("malformed", "oversized")


@QUICK
@given(json_values)
def test_valid_json_of_any_shape_is_read_back_or_refused(value: Any) -> None:
    payload = json.dumps({"command": value}).encode()
    try:
        frames = take_all(frame(payload), MAX_REPLY_BYTES)
    except ProtocolError:
        return
    assert len(frames) == 1


def test_a_deeply_nested_frame_is_a_protocol_error_not_a_recursion_error() -> None:
    payload = nested(30_000)  # 60 kB: within the request limit
    assert len(payload) < MAX_REQUEST_BYTES
    with pytest.raises(ProtocolError):  # a request holds few values: refused for that
        take_frame(bytearray(frame(payload)), max_bytes=MAX_REQUEST_BYTES)
    with pytest.raises(ProtocolError, match="nested deeper"):
        take_frame(bytearray(frame(payload)), max_bytes=MAX_REPLY_BYTES)
    # Brackets inside strings are text, not nesting.
    text = b'{"command":"' + b"[" * 1000 + b'"}'
    assert take_frame(bytearray(frame(text)), max_bytes=MAX_REQUEST_BYTES) == {
        "command": "[" * 1000}
    # The limit itself is allowed: real frames nest 4 levels.
    assert take_frame(bytearray(frame(nested(MAX_DEPTH - 1))),
                      max_bytes=MAX_REQUEST_BYTES) is not None


def test_the_largest_reply_the_limits_allow_keeps_memory_bounded() -> None:
    """The densest frame within the reply limit: values, not bytes, cost memory."""
    worst = b"[" + b",".join([b"[]"] * ((MAX_REPLY_BYTES - 2) // 3)) + b"]"
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="more than"):
            take_frame(bytearray(frame(worst)), max_bytes=MAX_REPLY_BYTES)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * MAX_REPLY_BYTES, f"{peak} bytes to refuse a {len(worst)}-byte frame"


@pytest.mark.slow  # a timing window: each frame's deadline
def test_a_frame_must_arrive_whole_within_its_deadline_however_it_is_sent() -> None:
    """One byte every 0.2 s never trips a per-read timeout of 1 s; the frame's
    deadline still ends it."""
    left, right = socket.socketpair()
    data = encode({"command": "start", "args": {}})
    stop = threading.Event()

    def dribble() -> None:
        for byte in data:
            if stop.wait(0.2):
                return
            try:
                left.sendall(bytes([byte]))
            except OSError:
                return

    sender = threading.Thread(target=dribble, daemon=True)
    sender.start()
    right.settimeout(1.0)
    try:
        with pytest.raises(TimeoutError):
            read_frame(right, max_bytes=MAX_REQUEST_BYTES, seconds=1.5)
    finally:
        stop.set()
        sender.join()
        left.close()
        right.close()


def real_reply(layers: int = 3) -> dict[str, Any]:
    recorder = Recorder(warmup_steps=0, max_layers=512)
    recorder.step_boundary("manual")
    for index in range(layers):  # a step's layer times count once the step ends
        recorder.add_layer_time(f"features.{index}", "forward", 0.001)
    recorder.step_boundary("manual")
    return {"ok": True, "probe": recorder.snapshot(), "settings": {"torch": {"version": "2"}},
            "dropped": {"malformed": 1}}


def test_a_real_reply_is_read_and_layers_only_when_asked() -> None:
    reply = real_reply()
    with_layers = ProbeSample.from_reply(1, reply, layers=True)
    assert [layer.name for layer in with_layers.layers] == [f"features.{i}" for i in range(3)]
    assert with_layers.steady_steps == 1
    assert ProbeSample.from_reply(1, reply, layers=False).layers == ()


def test_a_reply_with_more_layers_than_a_probe_keeps_is_refused_whole() -> None:
    """20,001 layers once became 80,067 series, with or without --layers."""
    reply = real_reply()
    reply["probe"]["layers"] = [[f"l{i}", 0.1, 1, 0.1, 1] for i in range(20_001)]
    for layers in (True, False):
        with pytest.raises(ProtocolError, match="layers"):
            ProbeSample.from_reply(1, reply, layers=layers)
    reply["probe"]["layers"] = reply["probe"]["layers"][:MAX_LAYER_ROWS]
    assert len(ProbeSample.from_reply(1, reply, layers=True).layers) == MAX_LAYER_ROWS


@pytest.mark.parametrize("path, value", [
    (("probe", "steps"), {"steady": -1}),
    (("probe", "steps"), {"steady": "1"}),
    (("probe", "step_seconds_sum"), float("nan")),
    (("probe", "step_bucket_counts"), [1, 2]),
    (("probe", "layers"), [["x" * 10_000, 0.1, 1, 0.1, 1]]),
    (("settings",), {"torch": {"version": "FAKE" * 1000}}),
    (("dropped",), {f"reason{i}": 1 for i in range(1000)}),
    (("probe",), []),
])
def test_a_reply_field_a_probe_would_not_send_is_a_protocol_error(
        path: tuple[str, ...], value: Any) -> None:
    reply = real_reply()
    holder = reply
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    with pytest.raises(ProtocolError):
        ProbeSample.from_reply(1, reply, layers=True)


@QUICK
@given(st.dictionaries(st.sampled_from(["probe", "settings", "dropped", "kernels", "ok"]),
                       json_values, max_size=5))
def test_any_reply_is_a_sample_or_a_protocol_error(reply: dict[str, Any]) -> None:
    with contextlib.suppress(ProtocolError):
        ProbeSample.from_reply(1, reply, layers=True)


@QUICK
@given(st.sampled_from(["step_source", "steps", "samples", "step_buckets",
                        "step_bucket_counts", "step_seconds_sum", "last_step_seconds",
                        "phase_seconds", "layers", "hook_errors"]), json_values)
def test_a_real_reply_with_any_one_field_replaced_is_a_sample_or_a_protocol_error(
        field: str, value: Any) -> None:
    reply = real_reply()
    reply["probe"][field] = value
    with contextlib.suppress(ProtocolError):
        ProbeSample.from_reply(1, reply, layers=True)


@QUICK
@given(st.sampled_from(["state", "reason", "kernels", "duration_buckets", "durations",
                        "memcpy", "layers", "overhead_seconds", "dropped_records",
                        "devices"]), json_values)
def test_a_kernel_reply_with_any_one_field_replaced_is_a_sample_or_a_protocol_error(
        field: str, value: Any) -> None:
    reply = real_reply()
    reply["kernels"] = {"state": "active", "reason": "", "kernels": [["gemm", 0, 3, 0.1]],
                        "duration_buckets": [1e-5, 1e-3], "durations": [[0, [1, 1, 1], 0.1]],
                        "memcpy": [[0, "h2d", 10, 0.1]], "layers": [["fc", "forward", 0.1]],
                        "overhead_seconds": 0.0, "dropped_records": 0,
                        "devices": {"0": "GPU-x"}}
    assert ProbeSample.from_reply(1, reply).kernels is not None
    reply["kernels"][field] = value
    with contextlib.suppress(ProtocolError):
        ProbeSample.from_reply(1, reply, layers=True)


def test_stale_sockets_of_dead_processes_are_removed_and_nothing_else(tmp_path: Path) -> None:
    from dlprof_agent.probe.protocol import remove_stale_sockets

    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    sockets = {}
    for name in (f"probe-{dead}.sock", f"probe-{os.getpid()}.sock", f"probe-{os.getppid()}.sock"):
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(tmp_path / name))
        server.close()
        sockets[name] = tmp_path / name
    not_a_socket = tmp_path / f"probe-{dead + 1 if dead < 4_000_000 else 3}.sock"
    not_a_socket.write_text("")
    remove_stale_sockets(str(tmp_path))
    assert not sockets[f"probe-{dead}.sock"].exists()  # its process is gone
    assert sockets[f"probe-{os.getpid()}.sock"].exists()  # alive
    assert sockets[f"probe-{os.getppid()}.sock"].exists()
    assert not_a_socket.exists()  # not a socket: not ours to remove


@st.composite
def hostile_frames(draw: st.DrawFn) -> bytes:
    """Random bytes, or a valid header over a random, deep or lying payload."""
    kind = draw(st.sampled_from(["bytes", "payload", "deep", "lying"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "payload":
        return frame(draw(st.binary(max_size=300)))
    if kind == "deep":
        return frame(nested(draw(st.integers(10, 30_000))))
    return frame(b'{"command":"snapshot"}', length=draw(st.integers(0, 2**32 - 1)))


@pytest.mark.slow  # hundreds of connections to a real listener
def test_the_probe_serves_on_whatever_its_clients_send(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random frames to a real probe's listener, before and inside a session:
    its thread lives on, nothing reaches it as an internal fault, and an agent
    is served afterwards."""
    from dlprof_agent.probe.protocol import SOCKET_DIR_ENV
    from dlprof_agent.probe.server import Probe

    monkeypatch.setenv(SOCKET_DIR_ENV, str(tmp_path / "run"))
    probe = Probe(persistent=True)
    assert probe.listen()
    start = encode({"command": "start", "args": {"kernels": False}})

    def talk(data: bytes, *, in_session: bool) -> None:
        with socket.socket(socket.AF_UNIX) as client:
            client.settimeout(5)
            client.connect(probe.path)
            try:
                if in_session:
                    client.sendall(start)
                    assert read_frame(client, max_bytes=MAX_REPLY_BYTES)["ok"]
                client.sendall(data)
                client.shutdown(socket.SHUT_WR)
                while client.recv(65536):
                    pass
            except (ConnectionResetError, BrokenPipeError):
                pass

    @QUICK
    @given(hostile_frames(), st.booleans())
    def feed(data: bytes, in_session: bool) -> None:
        talk(data, in_session=in_session)

    try:
        feed()
        assert probe._thread is not None and probe._thread.is_alive()
        assert "internal" not in probe.dropped, probe.dropped
        with socket.socket(socket.AF_UNIX) as agent:
            agent.settimeout(5)
            agent.connect(probe.path)
            agent.sendall(start)
            assert read_frame(agent, max_bytes=MAX_REPLY_BYTES)["ok"]
            agent.sendall(encode({"command": "snapshot"}))
            assert read_frame(agent, max_bytes=MAX_REPLY_BYTES)["ok"]
    finally:
        probe.close()


def test_a_job_with_more_than_a_thousand_files_open_is_served(tmp_path: Path) -> None:
    """Its sockets get descriptors past 1023, which select() cannot watch."""
    import subprocess
    import sys

    from tests.conftest import agent_env

    script = textwrap.dedent("""
        import os, resource, socket
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and hard < 2048:
            print("skip: the hard limit on open files is", hard); raise SystemExit
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
        held = [os.open("/dev/null", os.O_RDONLY) for _ in range(1100)]
        from dlprof_agent.probe.server import Probe
        from dlprof_agent.probe.protocol import encode, read_frame
        probe = Probe(persistent=True)
        assert probe.listen()
        agent = socket.socket(socket.AF_UNIX)
        agent.settimeout(5)
        agent.connect(probe.path)
        assert agent.fileno() > 1024
        agent.sendall(encode({"command": "start", "args": {"kernels": False}}))
        agent.sendall(encode({"command": "snapshot"}))
        print(*(read_frame(agent, max_bytes=1 << 22)["ok"] for _ in range(2)))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60, check=False,
                            env={**agent_env(), "DLPROF_AGENT_RUNTIME_DIR": str(tmp_path / "run")})
    if result.stdout.startswith("skip:"):
        pytest.skip(result.stdout.strip())
    assert result.stdout.strip() == "True True", result.stderr


def test_a_frame_already_there_is_read_though_the_job_starved_the_reader_past_its_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A job holding the GIL keeps the probe's thread between two reads of one frame
    (seen: a 2.5 s hold dropped an agent whose request had arrived whole)."""
    import time

    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(encode({"command": "snapshot"}))
        ours.settimeout(7.0)
        clock = iter([100.0, *(110.0 + step for step in range(100))])
        monkeypatch.setattr(time, "monotonic", lambda: next(clock))
        assert read_frame(ours, max_bytes=MAX_REQUEST_BYTES, seconds=5.0) == {
            "command": "snapshot"}
        assert ours.gettimeout() == 7.0  # the reply goes out under the socket's own


def test_a_frame_that_stops_arriving_still_times_out() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(encode({"command": "snapshot"})[:HEADER.size + 3])
        with pytest.raises(TimeoutError):
            read_frame(ours, max_bytes=MAX_REQUEST_BYTES, seconds=0.2)
