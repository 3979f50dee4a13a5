"""The wire types in probe/messages.py say what the probe really sends: every
command has its handler, and each reply carries the keys its type names."""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping

import pytest

from dlprof_agent.probe import handlers
from dlprof_agent.probe import kernel_tracer as kt
from dlprof_agent.probe.messages import (
    ErrorReply,
    HelloReply,
    KernelSnapshot,
    KernelTotals,
    OkReply,
    RecorderSnapshot,
    SnapshotReply,
    TraceStatus,
)
from dlprof_agent.probe.protocol import COMMANDS
from dlprof_agent.probe.recorder import LayerSampling, Recorder
from dlprof_agent.probe.session import DEFAULT_OPTIONS, Session
from tests.cupti_records import HTOD, BufferBuilder
from tests.fake_cupti import FakeBinding


def assert_shape(message: Mapping[str, object], kind: type) -> None:
    """``message`` has every key ``kind`` requires and none it does not name."""
    required: frozenset[str] = getattr(kind, "__required_keys__")  # noqa: B009
    optional: frozenset[str] = getattr(kind, "__optional_keys__")  # noqa: B009
    assert required <= set(message), (kind.__name__, sorted(required - set(message)))
    assert set(message) <= required | optional, (kind.__name__,
                                                 sorted(set(message) - required - optional))


@pytest.fixture
def session() -> Iterator[Session]:
    ours, theirs = socket.socketpair()
    session = Session(ours, 1, 0, DEFAULT_OPTIONS)
    try:
        yield session
    finally:
        session.remove_hooks()
        session.tracer.stop()
        ours.close()
        theirs.close()


def test_every_command_has_one_handler_or_opens_the_session() -> None:
    assert set(handlers.HANDLERS) | {"start"} == set(COMMANDS)
    assert "start" not in handlers.HANDLERS


def test_the_recorder_snapshot_is_a_recorder_snapshot() -> None:
    recorder = Recorder(warmup_steps=0)
    for step in range(3):
        recorder.step_boundary("optimizer", now=step * 0.1)
    assert_shape(recorder.snapshot(), RecorderSnapshot)
    sampled = Recorder(warmup_steps=0, layer_sampling=LayerSampling(every=2))
    assert "layer_sampled_steps" in sampled.snapshot()
    assert_shape(sampled.snapshot(), RecorderSnapshot)


def test_the_kernel_snapshot_is_a_kernel_snapshot_with_the_totals_once_traced() -> None:
    binding = FakeBinding()
    tracer = kt.KernelTracer(continuous=True, max_layers=512, binding_factory=lambda: binding,
                             cuda_check=lambda: True, profiler_check=lambda: "")
    assert_shape(tracer.snapshot(), KernelSnapshot)
    tracer.tick()
    binding.deliver(BufferBuilder().kernel("gemm", 0, 4_000).memcpy(HTOD, 64, 0, 1_000))
    tracer.tick()
    snapshot = tracer.snapshot()
    tracer.stop()
    assert_shape(snapshot, KernelSnapshot)
    totals: frozenset[str] = getattr(KernelTotals, "__required_keys__")  # noqa: B009
    assert totals <= set(snapshot)


def test_each_reply_of_a_session_is_of_its_type(session: Session) -> None:
    dropped: dict[str, int] = {}
    assert_shape(handlers.hello(session, dropped, pid=1, persistent=True), HelloReply)
    reply, ends = handlers.answer(session, {"command": "snapshot"}, dropped)
    assert_shape(reply, SnapshotReply)
    assert not ends
    reply, _ = handlers.answer(session, {"command": "configure", "args": {"layers": True}},
                               dropped)
    assert_shape(reply, OkReply)
    reply, _ = handlers.answer(session, {"command": "trace_status"}, dropped)
    assert_shape(reply, TraceStatus)
    reply, _ = handlers.answer(session, {"command": "configure", "args": {"x": 1}}, dropped)
    assert_shape(reply, ErrorReply)
    reply, ends = handlers.answer(session, {"command": "stop"}, dropped)
    assert_shape(reply, OkReply)
    assert ends
    assert dropped == {"malformed": 1}


def test_a_second_agent_hears_busy_and_whose(session: Session) -> None:
    dropped: dict[str, int] = {}
    reply, beside = handlers.answer_second(session, {"command": "start"}, 0, False, dropped)
    assert reply == {"ok": False, "error": "busy", "agent_pid": 1}
    assert not beside
    assert_shape(reply, ErrorReply)
