"""The kernel tracer's life in the probe: when it starts, busy and unavailable
states, giving way to torch.profiler, failures, and windowed traces. CUPTI is
the fake binding (``tests.fake_cupti``), fed synthetic buffers."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from dlprof_agent.exporters import chrome_trace as trace_writer
from dlprof_agent.probe import cupti_binding as cb
from dlprof_agent.probe import kernel_tracer as kt
from dlprof_agent.probe import profiler_yield, record_clock
from dlprof_agent.probe.recorder import LayerSampling, Recorder
from tests.cupti_records import HTOD, BufferBuilder
from tests.fake_cupti import (
    FakeBinding,
    FakeCupti,
    FakeKineto,
    SteppedTime,
    busy,
    now_on_cupti_clock,
    unavailable,
)


@pytest.fixture(autouse=True)
def _no_hooks_left() -> Iterator[None]:
    """Tracers register with the profiler hooks when they start: forget them after."""
    yield
    with profiler_yield._lock:
        profiler_yield._tracers.clear()
    profiler_yield.uninstall()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class World:
    """What the tracer looks at: CUDA in use, a profiler of the job's, the time."""

    def __init__(self, binding: FakeBinding | None = None, *, cuda: bool = True) -> None:
        self.cuda = cuda
        self.profiler = ""
        self.clock = Clock()
        self.bindings: list[FakeBinding] = []
        self.next_binding = binding

    def factory(self) -> FakeBinding:
        binding = self.next_binding or FakeBinding()
        self.next_binding = None
        self.bindings.append(binding)
        return binding

    def tracer(self, *, continuous: bool = True, labels: list[str] | None = None
               ) -> kt.KernelTracer:
        tracer = kt.KernelTracer(continuous=continuous, max_layers=512,
                                 binding_factory=self.factory, cuda_check=lambda: self.cuda,
                                 profiler_check=lambda: self.profiler, clock=self.clock)
        tracer.recorder = Recorder(warmup_steps=0)
        if labels is not None:
            tracer.set_layers(labels)
        return tracer

    def tick(self, tracer: kt.KernelTracer, seconds: float = 0.3) -> None:
        self.clock.now += seconds
        tracer.tick()


def just_ended(duration_ns: int) -> tuple[int, int]:
    """(start, end) of work that just finished, on CUPTI's clock as the fake reads
    it: CUPTI's records and cuptiGetTimestamp share one clock (record_clock)."""
    end = now_on_cupti_clock()
    return end - duration_ns, end


def kernels(snapshot: Mapping[str, Any]) -> dict[str, tuple[int, Any]]:
    return {name: (launches, seconds) for name, _, launches, seconds in snapshot["kernels"]
            if name != "calibration"}


def test_switched_off_it_never_touches_cupti() -> None:
    world = World()
    tracer = world.tracer(continuous=False)
    world.tick(tracer)
    assert world.bindings == []
    snapshot = tracer.snapshot()
    assert snapshot.pop("since") <= time.time()
    assert snapshot == {"state": "unavailable", "reason": "switched off (--no-kernels)",
                        "errors": 0}


def test_it_waits_for_the_job_to_use_cuda_then_traces() -> None:
    world = World(cuda=False)
    tracer = world.tracer()
    world.tick(tracer)
    assert (tracer.state, tracer.reason) == ("unavailable", "no CUDA in use")
    assert world.bindings == []

    world.cuda = True
    world.tick(tracer, kt.CUDA_CHECK_SECONDS)
    assert tracer.state == "active" and tracer.reason == ""
    binding = world.bindings[0]
    assert set(binding.enabled) == set(kt.KINDS)  # no attribution kinds without layers
    binding.deliver(BufferBuilder().kernel("ampere_sgemm_128x64_nn", *just_ended(2_000))
                    .memcpy(HTOD, 4096, *just_ended(1_000)).overhead(*just_ended(300)))
    binding.dropped = 3
    world.tick(tracer)

    snapshot = tracer.snapshot()
    assert kernels(snapshot) == {"ampere_sgemm_128x64_nn": (1, pytest.approx(2e-6))}
    assert snapshot["memcpy"] == [[0, "h2d", 4096, pytest.approx(1e-6)]]
    assert snapshot["overhead_seconds"] == pytest.approx(3e-7)
    assert snapshot["dropped_records"] == 3
    assert binding.released == 1  # the buffer went back to the pool
    assert binding.size_questions == 3  # each kind's size asked of CUPTI once


def test_a_busy_cupti_is_reported_with_its_holder_and_retried() -> None:
    world = World(busy("CUPTI is held by nsys"))
    tracer = world.tracer()
    world.tick(tracer)
    assert (tracer.state, tracer.reason) == ("busy", "CUPTI is held by nsys")
    world.tick(tracer, 1.0)
    assert len(world.bindings) == 1  # not before BUSY_RETRY_SECONDS
    world.tick(tracer, kt.BUSY_RETRY_SECONDS)
    assert len(world.bindings) == 2 and tracer.state == "active"


def test_unavailable_says_why_and_is_not_retried() -> None:
    world = World(unavailable())
    tracer = world.tracer()
    world.tick(tracer)
    world.tick(tracer, 3600)
    assert (tracer.state, tracer.reason) == (
        "unavailable", "cupti-python not installed in the job's environment")
    assert len(world.bindings) == 1


def test_it_gives_way_to_torch_profiler_and_comes_back_with_its_counters() -> None:
    world = World()
    tracer = world.tracer()
    world.tick(tracer)
    first = world.bindings[0]
    first.deliver(BufferBuilder().kernel("k", *just_ended(1_000)))
    world.tick(tracer)

    world.profiler = "torch.profiler"
    first.deliver(BufferBuilder().kernel("k", *just_ended(1_000)))  # completed before it yielded
    world.tick(tracer)
    assert (tracer.state, tracer.reason) == ("busy", "torch.profiler is running")
    assert first.abandoned and not first.closed  # its kinds are the profiler's now
    assert tracer.correlator is None

    world.profiler = ""
    world.tick(tracer, kt.YIELD_RETRY_SECONDS)
    assert tracer.state == "active" and len(world.bindings) == 2
    world.bindings[1].deliver(BufferBuilder().kernel("k", *just_ended(1_000)))
    world.tick(tracer)
    assert kernels(tracer.snapshot()) == {"k": (3, pytest.approx(3e-6))}


def test_a_failure_of_its_own_is_counted_and_never_raised() -> None:
    world = World()
    tracer = world.tracer()
    world.tick(tracer)
    world.bindings[0].fail_on_take = RuntimeError("boom")
    world.tick(tracer)  # does not raise
    assert tracer.state == "unavailable"
    assert tracer.reason == "tracer failed: RuntimeError: boom"
    assert tracer.errors == 1
    assert world.bindings[0].closed
    world.tick(tracer, 3600)
    assert len(world.bindings) == 1


def test_stop_hands_cupti_back_after_the_last_records() -> None:
    world = World()
    tracer = world.tracer()
    world.tick(tracer)
    world.bindings[0].deliver(BufferBuilder().kernel("k", *just_ended(1_000)))
    tracer.stop()
    assert world.bindings[0].closed
    assert kernels(tracer.snapshot()) == {"k": (1, pytest.approx(1e-6))}


def test_layers_get_their_kernel_time_through_the_correlator() -> None:
    world = World()
    labels = ["conv", "fc"]
    tracer = world.tracer(labels=labels)
    world.tick(tracer)
    binding = world.bindings[0]
    assert {39, 5, 4} <= set(binding.enabled)  # external correlation, runtime, driver
    base = tracer.correlator.base
    binding.deliver(BufferBuilder()
                    .external(1, base | 1 << 1).api(1)
                    .kernel("gemm", *just_ended(4_000), correlation=1)
                    .external(2, base | 0 << 1 | 1).api(2).kernel("wgrad", *just_ended(1_000),
                                                                  correlation=2))
    world.tick(tracer)
    assert sorted(tracer.snapshot()["layers"]) == [["conv", "backward", pytest.approx(1e-6)],
                                                   ["fc", "forward", pytest.approx(4e-6)]]


# --- windowed traces ----------------------------------------------------------------


def step_at(tracer: kt.KernelTracer, perf_seconds: float) -> None:
    tracer.recorder.step_boundary("optimizer", perf_seconds)


def test_a_trace_window_holds_the_steps_layers_and_the_kernels_launched_in_it() -> None:
    world = World()
    tracer = world.tracer(labels=["conv"])
    world.tick(tracer)
    binding = world.bindings[0]
    assert tracer.start_capture(2, 60) == ""
    assert {5, 4} <= set(binding.enabled)  # launch times for the window's cut

    t0 = time.perf_counter()
    cupti = now_on_cupti_clock
    base = tracer.correlator.base
    before = BufferBuilder().api(1, start=cupti(t0 - 0.5)).kernel("early", cupti(t0 - 0.4),
                                                                   cupti(t0 - 0.3), correlation=1)
    binding.deliver(before)
    world.tick(tracer)
    step_at(tracer, t0)  # the window opens
    tracer.capture.layer("conv", "forward", t0 + 0.01, t0 + 0.02)  # type: ignore[union-attr]
    inside = (BufferBuilder()
              .external(2, base | 0).api(2, start=cupti(t0 + 0.011))
              .kernel("conv_kernel", cupti(t0 + 0.012), cupti(t0 + 0.015), correlation=2,
                      stream=13)
              .api(3, start=cupti(t0 + 0.03))
              .memcpy(HTOD, 1 << 20, cupti(t0 + 0.031), cupti(t0 + 0.032), correlation=3))
    binding.deliver(inside)
    world.tick(tracer)
    step_at(tracer, t0 + 0.1)
    step_at(tracer, t0 + 0.2)  # two steps: the window closes
    late = (BufferBuilder().api(4, start=cupti(t0 + 0.19))
            .kernel("last_kernel_runs_late", cupti(t0 + 0.25), cupti(t0 + 0.26), correlation=4)
            .api(5, start=cupti(t0 + 0.21)).kernel("next_step", cupti(t0 + 0.27),
                                                    cupti(t0 + 0.28), correlation=5))
    binding.deliver(late)
    assert tracer.capture_status(0)["phase"] == "collecting"
    world.tick(tracer)
    world.tick(tracer, kt.COLLECT_SECONDS)
    status = tracer.capture_status(0)

    assert status["phase"] == "done" and status["steps"] == 2
    assert binding.flushes >= 1
    payload = json.loads(status["data"])
    assert len(status["data"]) == status["size"]
    assert tracer.capture is None  # delivered and freed
    names = [payload["names"][payload["full_to_name"][i]] for i in payload["kernels"]["name"]]
    assert names == ["conv_kernel", "last_kernel_runs_late"]
    assert payload["kernels"]["layer"] == [0, -1] and payload["labels"] == ["conv"]
    assert payload["memcpy"]["kind"] == ["h2d"]
    # The clocks are aligned by sampling both: good to a few microseconds.
    assert payload["steps"] == pytest.approx([cupti(t0), cupti(t0 + 0.1), cupti(t0 + 0.2)],
                                             abs=5_000)
    assert payload["layers"][0][:2] == ["conv", 0]
    assert payload["layers"][0][2:4] == pytest.approx([cupti(t0 + 0.01), cupti(t0 + 0.02)],
                                                      abs=5_000)
    assert set(binding.enabled) == set(kt.KINDS) | {39, 5, 4}  # attribution keeps its kinds

    trace = trace_writer.chrome_trace(payload, pid=4242)
    kernel = next(e for e in trace["traceEvents"] if e.get("name") == "conv_kernel")
    assert kernel["ts"] == pytest.approx(12_000, abs=1) and kernel["dur"] == pytest.approx(
        3_000, abs=1)
    assert kernel["args"]["layer"] == "conv" and kernel["tid"] == 13


def test_without_launch_records_the_window_is_cut_by_start_time() -> None:
    world = World()
    tracer = world.tracer()
    world.tick(tracer)
    binding = world.bindings[0]
    assert tracer.start_capture(1, 60) == ""
    t0 = time.perf_counter()
    step_at(tracer, t0)
    step_at(tracer, t0 + 0.1)
    binding.deliver(BufferBuilder()
                    .kernel("before", now_on_cupti_clock(t0 - 0.01), now_on_cupti_clock(t0))
                    .kernel("inside", now_on_cupti_clock(t0 + 0.05),
                            now_on_cupti_clock(t0 + 0.06)))
    world.tick(tracer)
    world.tick(tracer, kt.COLLECT_SECONDS)
    # No GPU work after the window yet: it may still be running the window's.
    assert tracer.capture_status(0)["phase"] == "collecting"
    world.tick(tracer, kt.MAX_COLLECT_SECONDS)  # a GPU gone idle: wait no longer
    payload = json.loads(tracer.capture_status(0)["data"])
    assert [payload["names"][payload["full_to_name"][i]]
            for i in payload["kernels"]["name"]] == ["inside"]
    assert set(world.bindings[0].enabled) == set(kt.KINDS)  # the window's kinds are off again


def test_a_trace_says_why_it_cannot_be_had() -> None:
    world = World(cuda=False)
    tracer = world.tracer()
    assert tracer.start_capture(3, 60) == "no GPU in use: the process has not started CUDA"

    world = World(busy("CUPTI is held by Nsight Systems"))
    tracer = world.tracer()
    assert tracer.start_capture(3, 60) == "tracing busy: CUPTI is held by Nsight Systems"

    world = World(unavailable())
    tracer = world.tracer()
    world.tick(tracer)
    assert tracer.start_capture(3, 60) == (
        "kernel tracing unavailable: cupti-python not installed in the job's environment")

    world = World()
    tracer = world.tracer()
    assert tracer.start_capture(3, 60) == ""
    assert tracer.start_capture(3, 60) == (
        "tracing busy: a trace of this process is already being taken")


def test_a_window_that_never_fills_fails_at_its_deadline() -> None:
    world = World()
    tracer = world.tracer()
    assert tracer.start_capture(5, 10) == ""
    step_at(tracer, time.perf_counter())
    step_at(tracer, time.perf_counter())
    world.tick(tracer, 11)
    status = tracer.capture_status(0)
    assert status == {"ok": False, "phase": "failed", "steps": 1, "wanted": 5,
                      "error": "only 1 of 5 steps before the time limit"}
    assert tracer.recorder.capture is None


def test_with_kernels_switched_off_a_trace_starts_cupti_for_its_window_only() -> None:
    world = World()
    tracer = world.tracer(continuous=False)
    assert tracer.start_capture(1, 60) == ""
    assert tracer.state == "active"
    t0 = time.perf_counter()
    step_at(tracer, t0)
    step_at(tracer, t0 + 0.01)
    world.tick(tracer)
    world.tick(tracer, kt.MAX_COLLECT_SECONDS)
    assert tracer.capture_status(0)["phase"] == "done"
    assert world.bindings[0].closed
    assert (tracer.state, tracer.reason) == ("unavailable", "switched off (--no-kernels)")
    world.tick(tracer, 60)
    assert len(world.bindings) == 1


def test_a_paused_session_lets_go_of_cupti_and_takes_it_again_when_resumed() -> None:
    from dlprof_agent.probe.session import DEFAULT_OPTIONS, Session, checked_options

    world = World()
    left, right = socket.socketpair()
    with left, right:
        session = Session(left, 1, 0, checked_options({"warmup_steps": 0}, DEFAULT_OPTIONS))
        session.tracer = world.tracer()
        world.tick(session.tracer)
        assert session.tracer.state == "active"

        errors: dict[str, int] = {}
        session.reconfigure(checked_options({"paused": True}, session.options()), errors)
        assert world.bindings[0].closed  # paused is off: the job runs as without an agent
        assert (session.tracer.state, session.tracer.reason) == ("unavailable",
                                                                 "paused by the agent")
        assert session.options()["kernels"] is True  # what was asked for is kept
        world.tick(session.tracer, 60)
        assert len(world.bindings) == 1

        session.reconfigure(checked_options({"paused": False}, session.options()), errors)
        world.tick(session.tracer)
        assert session.tracer.state == "active" and len(world.bindings) == 2
        assert errors == {}
        session.remove_hooks()  # resuming hooked the frameworks this process imported


# --- on a faithful fake CUPTI: the real binding, Kineto beside it ----------------------


@pytest.fixture
def cupti(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCupti]:
    """A fresh process-wide CUPTI, buffer pool and profiler hooks for one test."""
    monkeypatch.setattr(cb, "_pool", None)
    monkeypatch.setattr(cb, "_callbacks", None)
    # The records' clock is measured over a short baseline here (record_clock).
    monkeypatch.setattr(record_clock, "CALIBRATION_SECONDS", 0.2)
    # Its clock and the probe's perf_counter move only when the test moves them:
    # measured rates and durations are exact under any load.
    fake = FakeCupti(time_source=SteppedTime())
    yield fake
    with profiler_yield._lock:
        profiler_yield._tracers.clear()
    profiler_yield.uninstall()
    if cb._pool is not None:
        cb._pool.trim()


def kineto_ran(fake: FakeCupti) -> None:
    """torch.profiler ran once in the job: Kineto's clock stays on CUPTI's records."""
    kineto = FakeKineto(fake)
    kineto.prepare()
    kineto.stop()


def settle_clock(world: World, tracer: kt.KernelTracer, fake: FakeCupti) -> float:
    """Kernels of a busy GPU until the tracer knows its records' clock; its
    ticks per ns. Their name, "calibration", is left out of ``kernels``."""
    assert fake.time_source is not None
    for _ in range(100_000):
        if tracer._record_clock is not None and tracer._record_clock.state != "unknown":
            return tracer._record_clock.ticks_per_ns
        fake.kernel("calibration", 1_000)
        world.tick(tracer)
        fake.time_source.sleep(0.002)  # a busy GPU's pace
    raise AssertionError("the records' clock was never measured")


def real_tracer(world: World, fake: FakeCupti, **options: Any) -> kt.KernelTracer:
    """The tracer, on the real binding, on ``fake`` and its time."""
    assert fake.time_source is not None
    tracer = kt.KernelTracer(continuous=True, max_layers=512,
                             binding_factory=lambda: cb.CuptiBinding(load=fake.load),
                             cuda_check=lambda: world.cuda,
                             profiler_check=lambda: world.profiler, clock=world.clock,
                             environ=options.get("environ", {}),
                             perf_ns=fake.time_source.perf_ns,
                             sleep=fake.time_source.sleep)
    tracer.recorder = Recorder(warmup_steps=0)
    return tracer


def test_a_quiet_jobs_records_reach_the_snapshot_within_two_ticks(cupti: FakeCupti) -> None:
    # GPU evidence item 1: 50 x 8 MiB copies never filled a 4 MiB buffer, so CUPTI's
    # periodic flush never handed one over and no byte was counted.
    world = World()
    tracer = real_tracer(world, cupti)
    world.tick(tracer)
    assert tracer.state == "active"
    for _ in range(3):
        cupti.memcpy(HTOD, 8 << 20, 160_000)
    cupti.kernel("one_kernel_a_second", 5_000)
    cupti.periodic_flush()  # CUPTI's worker: only full buffers, so nothing yet
    world.tick(tracer)
    world.tick(tracer)
    snapshot = tracer.snapshot()
    assert snapshot["memcpy"] == [[0, "h2d", 3 * (8 << 20), pytest.approx(480e-6)]]
    assert kernels(snapshot) == {"one_kernel_a_second": (1, pytest.approx(5e-6))}
    assert "flush_all(1)" not in cupti.calls  # never forced: running kernels stay out


def test_a_running_kernel_is_not_handed_over_half_done(cupti: FakeCupti) -> None:
    world = World()
    tracer = real_tracer(world, cupti)
    world.tick(tracer)
    cupti.kernel("long", 1_000_000, running=True)
    world.tick(tracer)
    assert "kernels" not in tracer.snapshot() or not kernels(tracer.snapshot())
    cupti.finish_running()
    world.tick(tracer)
    assert kernels(tracer.snapshot()) == {"long": (1, pytest.approx(1e-3))}


def test_a_profiler_that_ran_before_the_attach_leaves_tracing_possible(
        cupti: FakeCupti) -> None:
    # GPU evidence item 2: Kineto keeps its CUPTI subscriber after torch.profiler stops;
    # a tracer that asks for one of its own is busy for good.
    kineto = FakeKineto(cupti)
    kineto.prepare()
    cupti.kernel("profiled", 1_000)
    kineto.stop()
    assert cupti.subscribers == ["<not provided>"]

    world = World()
    tracer = real_tracer(world, cupti)
    world.tick(tracer)
    world.tick(tracer, kt.BUSY_RETRY_SECONDS)
    assert (tracer.state, tracer.reason) == ("active", "")
    settle_clock(world, tracer, cupti)  # Kineto's clock is still on the records
    cupti.kernel("after", 4_000)
    world.tick(tracer)
    assert kernels(tracer.snapshot()) == {"after": (1, pytest.approx(4e-6, rel=1e-2))}


def test_durations_stay_in_ns_after_kineto_installed_its_clock_told_by_the_records(
        cupti: FakeCupti) -> None:
    # GPU evidence item 4: after torch.profiler had run, every kernel came out 2.10x
    # too long: Kineto's TSC timestamp callback stays registered. Here cuptiGetTimestamp
    # keeps CUPTI's own clock (as documented), so only the records' ends tell.
    cupti.timestamp_follows_callback = False
    kineto = FakeKineto(cupti)
    kineto.prepare()
    cupti.kernel("profiled", 10_000)
    kineto.stop()
    assert kineto.kernels[0][1] - kineto.kernels[0][0] == pytest.approx(10_000, abs=1)

    world = World()
    tracer = real_tracer(world, cupti)
    world.tick(tracer)
    assert cupti.calls.count("timestamp_default") == 1  # asked at open: refused, answer 1
    cupti.kernel("gemm", 10_000)
    world.tick(tracer)
    assert kernels(tracer.snapshot()) == {}  # held until the records' clock is known
    assert settle_clock(world, tracer, cupti) == pytest.approx(2.10, rel=1e-2)
    assert kernels(tracer.snapshot()) == {"gemm": (1, pytest.approx(10e-6, rel=1e-2))}
    assert tracer.snapshot()["record_clock"]["measured_by"] == "records"
    cupti.kernel("gemm", 30_000)
    world.tick(tracer)
    assert kernels(tracer.snapshot()) == {"gemm": (2, pytest.approx(40e-6, rel=1e-2))}

    # The next profiler session registers its clock again and gets its own units.
    kineto.prepare()
    cupti.kernel("profiled", 7_000)
    kineto.stop()
    assert kineto.kernels[-1][1] - kineto.kernels[-1][0] == pytest.approx(7_000, abs=1)


def test_a_trace_after_kineto_ran_has_right_times_and_durations(cupti: FakeCupti) -> None:
    kineto_ran(cupti)
    world = World()
    tracer = real_tracer(world, cupti)
    world.tick(tracer)
    settle_clock(world, tracer, cupti)
    assert tracer.start_capture(1, 60) == ""
    assert cupti.time_source is not None
    t0 = cupti.time_source.perf_seconds()
    step_at(tracer, t0)
    cupti.kernel("conv_kernel", 3_000_000, start_ns=now_on_cupti_clock(t0 + 0.012))
    step_at(tracer, t0 + 0.1)
    cupti.kernel("next_step", 1_000, start_ns=now_on_cupti_clock(t0 + 0.2))
    world.tick(tracer)
    world.tick(tracer, kt.COLLECT_SECONDS)
    payload = json.loads(tracer.capture_status(0)["data"])
    trace = trace_writer.chrome_trace(payload, pid=4242)
    kernel = next(e for e in trace["traceEvents"] if e.get("name") == "conv_kernel")
    # us from the window's start; on a foreign clock, placed to within the lag
    # between a kernel's end and the drain that read it (sub-ms on a busy GPU)
    assert kernel["ts"] == pytest.approx(12_000, abs=500)
    assert kernel["dur"] == pytest.approx(3_000, rel=1e-2)


def test_an_injected_nsight_is_left_alone(cupti: FakeCupti) -> None:
    world = World()
    tracer = real_tracer(world, cupti, environ={
        "CUDA_INJECTION64_PATH": "/opt/nsight-systems/target-linux-x64/libToolsInjection64.so"})
    world.tick(tracer)
    world.tick(tracer, kt.BUSY_RETRY_SECONDS)
    assert (tracer.state, tracer.reason) == ("busy", "CUPTI is held by Nsight Systems")
    assert cupti.callbacks is None and not cupti.enabled  # CUPTI never touched
    assert tracer.start_capture(2, 60) == "tracing busy: CUPTI is held by Nsight Systems"


torch_profiler_entry = "torch.autograd.profiler"


@pytest.fixture
def kineto_behind_torch(cupti: FakeCupti, monkeypatch: pytest.MonkeyPatch) -> FakeKineto:
    """torch's profiler entry points, with the fake Kineto doing on the fake CUPTI
    what the real one does on CUPTI inside them (this torch has no CUDA)."""
    profiler = pytest.importorskip(torch_profiler_entry)
    kineto = FakeKineto(cupti)
    prepare, disable = profiler._prepare_profiler, profiler._disable_profiler

    def prepared(*args: Any, **kwargs: Any) -> Any:
        kineto.prepare()
        return prepare(*args, **kwargs)

    def disabled(*args: Any, **kwargs: Any) -> Any:
        kineto.stop()
        return disable(*args, **kwargs)

    monkeypatch.setattr(profiler, "_prepare_profiler", prepared)
    monkeypatch.setattr(profiler, "_disable_profiler", disabled)
    return kineto


@pytest.mark.slow  # imports torch
def test_torch_profiler_gets_every_kernel_while_the_probe_traces(
        cupti: FakeCupti, kineto_behind_torch: FakeKineto) -> None:
    # GPU evidence item 3: with the probe tracing, torch.profiler got 0 kernels over
    # 100 steps (Kineto: CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED).
    import torch

    kineto = kineto_behind_torch
    world = World()
    tracer = real_tracer(world, cupti)
    world.tick(tracer)
    cupti.kernel("before", 2_000)
    world.tick(tracer)
    cupti.kernel("still_running", 2_000, running=True)  # its buffer must not go to Kineto
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        # Stood aside synchronously, before Kineto's first CUPTI call.
        assert (tracer.state, tracer.reason) == ("busy", "torch.profiler is running")
        assert tracer.holder == "torch.profiler"
        assert time.time() - tracer.snapshot()["since"] < 60
        for _ in range(5):
            cupti.kernel("profiled", 3_000)
        world.tick(tracer)  # the probe thread meanwhile: it stays aside
        assert tracer.state == "busy"
    assert not kineto.failed
    assert [end - start for start, end in kineto.kernels] == [3_000] * 5
    assert kineto.foreign_buffers == 0  # none of ours went to Kineto's callbacks

    world.tick(tracer)  # back: our callbacks registered again, on Kineto's clock now
    assert tracer.state == "active" and tracer.holder == ""
    assert settle_clock(world, tracer, cupti) == pytest.approx(2.10, rel=1e-2)
    cupti.kernel("after", 2_000)
    world.tick(tracer)
    assert kernels(tracer.snapshot()) == {"before": (1, pytest.approx(2e-6)),
                                          "after": (1, pytest.approx(2e-6, rel=1e-2))}
    assert cb._pool is not None and cb._pool.foreign_buffers == 0


def test_a_profiler_the_hooks_missed_is_still_stood_aside_for(cupti: FakeCupti) -> None:
    world = World()
    tracer = real_tracer(world, cupti)
    world.tick(tracer)
    world.profiler = "torch.profiler"  # running, started where no hook sees it
    kineto = FakeKineto(cupti)
    kineto.prepare()
    world.tick(tracer)
    assert (tracer.state, tracer.reason) == ("busy", "torch.profiler is running")
    assert {10, 1, 2} <= cupti.enabled  # its kinds left on: they are Kineto's too
    cupti.kernel("profiled", 1_000)
    kineto.stop()
    world.profiler = ""
    world.tick(tracer, kt.YIELD_RETRY_SECONDS)
    assert tracer.state == "active"
    assert len(kineto.kernels) == 1


@pytest.mark.slow  # imports TensorFlow
def test_tensorflows_profiler_is_stood_aside_for_too(cupti: FakeCupti, tmp_path: Any) -> None:
    tf = pytest.importorskip("tensorflow")
    world = World()
    tracer = real_tracer(world, cupti)
    world.tick(tracer)
    assert tracer.state == "active"
    tf.profiler.experimental.start(str(tmp_path))  # as Keras' TensorBoard callback does
    try:
        assert (tracer.state, tracer.reason) == ("busy", "TensorFlow's profiler is running")
        assert not cupti.enabled  # our kinds off before its session began
    finally:
        tf.profiler.experimental.stop()
    world.tick(tracer)
    assert tracer.state == "active"
    with tf.profiler.experimental.Profile(str(tmp_path)):  # calls profiler_v2's globals
        assert tracer.state == "busy"
    world.tick(tracer)
    assert tracer.state == "active"
    tracer.stop()
    assert tf.profiler.experimental.start.__module__ == "tensorflow.python.profiler.profiler_v2"


@pytest.mark.slow  # imports torch
def test_a_profiler_already_running_when_tracing_starts_is_waited_for(cupti: FakeCupti) -> None:
    """The fallback for a profiler the hooks did not see start: checked on the
    probe's own thread, where torch's per-thread profiler flag reads false."""
    torch = pytest.importorskip("torch")
    world = World()
    tracer = kt.KernelTracer(continuous=True, max_layers=512,
                             binding_factory=lambda: cb.CuptiBinding(load=cupti.load),
                             cuda_check=lambda: True, clock=world.clock)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        probe_thread = threading.Thread(target=tracer.tick)
        probe_thread.start()
        probe_thread.join()
        assert (tracer.state, tracer.reason) == ("busy", "torch.profiler is running")
        assert cupti.callbacks is None  # CUPTI untouched while it runs
    world.tick(tracer, kt.YIELD_RETRY_SECONDS)
    assert tracer.state == "active"


# --- attribution in timed steps only (duty-cycled layer timing) -------------------------

LAYER_KERNEL_NS = (40_000, 10_000, 25_000)  # per layer and launch: forward, twice backward


class SampledJob:
    """A job whose layer hooks are in only for the recorder's timed steps, as
    ``torch_hooks`` does it: each layer pushes its id around its launches while
    timed; every step launches the same kernels whether timed or not."""

    def __init__(self, world: World, cupti: FakeCupti, *, every: int) -> None:
        self.world, self.cupti = world, cupti
        self.tracer = real_tracer(world, cupti)
        self.recorder = Recorder(warmup_steps=0, layer_sampling=LayerSampling(every=every))
        self.tracer.recorder = self.recorder
        self.labels = [f"{index} Conv2d" for index in range(len(LAYER_KERNEL_NS))]
        self.tracer.set_layers(self.labels)
        self.now = 0.0
        self.kinds_seen: list[tuple[bool, set[int]]] = []  # (timed, enabled) per step

    def boundary(self) -> None:
        self.now += 0.01
        self.recorder.step_boundary("manual", self.now)

    def step(self, scale: float = 1.0) -> None:
        """One step's launches, then its closing boundary."""
        timed = self.recorder.layer_step
        self.kinds_seen.append((timed, set(self.cupti.enabled)))
        correlator = self.tracer.correlator
        for index, nanoseconds in enumerate(LAYER_KERNEL_NS):
            for phase, launches in ((0, 1), (1, 2)):
                if timed and correlator is not None:
                    correlator.push(correlator.base | index << 1 | phase)
                for _ in range(launches):
                    self.cupti.kernel(f"layer_{index}", round(nanoseconds * scale))
                if timed and correlator is not None:
                    correlator.pop()
        self.boundary()
        self.world.tick(self.tracer, 0.3)

    def layer_gpu_seconds(self) -> dict[tuple[str, str], float]:
        return {(label, phase): seconds
                for label, phase, seconds in self.tracer.snapshot()["layers"]}


def expected_gpu_seconds(labels: list[str], scales: list[float]
                         ) -> dict[tuple[str, str], float]:
    """What timing every step attributes: each launch's duration, all steps."""
    expected = {}
    for label, nanoseconds in zip(labels, LAYER_KERNEL_NS, strict=True):
        every_step = [round(nanoseconds * scale) / 1e9 for scale in scales]
        expected[(label, "forward")] = sum(every_step)
        expected[(label, "backward")] = 2 * sum(every_step)
    return expected


@pytest.mark.parametrize("every", [2, 5, 8])
def test_sampled_steps_gpu_time_per_layer_stands_for_every_step(
        cupti: FakeCupti, every: int) -> None:
    """Steps all alike, a run ending on a timed step: one in N timed, weighted by N,
    is exactly what timing every step gives (floating point aside)."""
    job = SampledJob(World(), cupti, every=every)
    job.world.tick(job.tracer)
    assert job.tracer.state == "active"
    job.boundary()
    steps = 40 * every  # the last step closed is a timed one
    for _ in range(steps):
        job.step()
    assert job.recorder.layer_sampled_steps == steps // every
    assert job.layer_gpu_seconds() == pytest.approx(
        expected_gpu_seconds(job.labels, [1.0] * steps), rel=1e-9)
    # Continuous aggregation counts every step's kernels, timed or not.
    launched = kernels(job.tracer.snapshot())
    assert {name: count for name, (count, _) in launched.items()} == {
        f"layer_{index}": 3 * steps for index in range(len(LAYER_KERNEL_NS))}


def test_sampled_gpu_time_per_layer_is_within_sampling_error_of_every_step(
        cupti: FakeCupti) -> None:
    """Kernel times that vary step to step (uniform within +-30%, a seeded draw):
    one step in five estimates the 1000 steps' total from 200 of them. Each step's
    factor has a standard deviation of 0.3/sqrt(3) = 0.17, so the estimate's
    relative error has one of 0.17 * sqrt(1/200 - 1/1000) = 1.1%: 5% is over 4 of
    them, and the old estimate (timed steps only, unweighted) is 80% short."""
    import random

    draw = random.Random(12)
    scales = [draw.uniform(0.7, 1.3) for _ in range(1000)]
    job = SampledJob(World(), cupti, every=5)
    job.world.tick(job.tracer)
    job.boundary()
    for scale in scales:
        job.step(scale)
    expected = expected_gpu_seconds(job.labels, scales)
    measured = job.layer_gpu_seconds()
    assert set(measured) == set(expected)
    for key, seconds in expected.items():
        assert measured[key] == pytest.approx(seconds, rel=0.05), key


def test_attribution_kinds_are_on_in_timed_steps_only_and_never_while_standing_aside(
        cupti: FakeCupti) -> None:
    job = SampledJob(World(), cupti, every=4)
    job.world.tick(job.tracer)
    job.boundary()
    for _ in range(20):
        job.step()
    attribution = set(kt.ATTRIBUTION_KINDS)
    assert {timed for timed, _ in job.kinds_seen} == {True, False}
    for timed, enabled in job.kinds_seen:
        assert set(kt.KINDS) <= enabled  # continuous tracing stays on throughout
        assert (enabled & attribution) == (attribution if timed else set())

    # torch.profiler is about to start: we stand aside, and timed steps must not
    # turn our kinds back on under it.
    job.tracer.stand_aside(profiler_yield.TORCH_PROFILER)
    job.kinds_seen.clear()
    for _ in range(8):
        job.recorder.step_boundary("manual", job.now + 0.01)
        job.now += 0.01
        job.kinds_seen.append((job.recorder.layer_step, set(cupti.enabled)))
        job.world.tick(job.tracer)  # the profiler's flag is down: the hook is the signal
    assert any(timed for timed, _ in job.kinds_seen)
    assert all(not enabled for _, enabled in job.kinds_seen)

    job.tracer.come_back(profiler_yield.TORCH_PROFILER)
    job.world.tick(job.tracer)
    assert job.tracer.state == "active"
    job.kinds_seen.clear()
    for _ in range(8):
        job.step()
    for timed, enabled in job.kinds_seen:
        assert (enabled & attribution) == (attribution if timed else set())


def test_a_timed_step_never_waits_for_a_tick_and_gets_its_kinds_as_the_tick_ends(
        cupti: FakeCupti) -> None:
    every = 4
    job = SampledJob(World(), cupti, every=every)
    job.world.tick(job.tracer)
    job.boundary()
    sampling = job.recorder.layer_sampling
    assert sampling is not None
    while job.recorder.layer_step or sampling.since_sample != every - 2:
        job.step()  # up to the last untimed step before a timed one
    assert not set(kt.ATTRIBUTION_KINDS) & cupti.enabled
    # A tick holds the tracer's lock (here: stuck in its check for a profiler)
    # just as the timed step begins on the job's thread.
    release, checking = threading.Event(), threading.Event()

    def slow_check() -> str:
        checking.set()
        release.wait(10)
        return ""

    job.tracer._profiler_check = slow_check
    job.world.clock.now += 1.0
    tick = threading.Thread(target=job.tracer.tick)
    tick.start()
    assert checking.wait(10)
    started = time.perf_counter()
    job.boundary()
    assert job.recorder.layer_step
    assert time.perf_counter() - started < 1.0  # it did not wait for the lock
    assert not set(kt.ATTRIBUTION_KINDS) & cupti.enabled
    release.set()
    tick.join(10)
    assert set(kt.ATTRIBUTION_KINDS) <= cupti.enabled  # applied as the tick let go


def test_records_on_cuptis_own_clock_are_counted_at_once_and_never_rescaled(
        cupti: FakeCupti) -> None:
    world = World()
    tracer = real_tracer(world, cupti)
    world.tick(tracer)
    cupti.kernel("gemm", 10_000)
    world.tick(tracer)
    world.tick(tracer)  # CUPTI hands a partly filled buffer over at the next flush
    assert tracer._record_clock is not None and tracer._record_clock.state == "native"
    assert kernels(tracer.snapshot()) == {"gemm": (1, pytest.approx(10e-6))}


def test_a_cupti_timestamp_on_kinetos_clock_gives_its_rate_at_open(cupti: FakeCupti) -> None:
    # On the H100 cuptiGetTimestamp followed Kineto's clock (evidence 2026-11-26 run-2):
    # its own rate against perf_counter gives the ticks per ns at once, nothing held.
    kineto_ran(cupti)
    world = World()
    tracer = real_tracer(world, cupti)
    world.tick(tracer)
    assert tracer._record_clock is not None
    assert tracer._record_clock.state == "foreign"
    assert tracer._record_clock.ticks_per_ns == pytest.approx(2.10, rel=1e-2)
    assert tracer.snapshot()["record_clock"] == {
        "clock": "foreign", "measured_by": "rate", "ticks_per_ns": pytest.approx(2.10, rel=1e-2)}
    cupti.kernel("gemm", 10_000)
    world.tick(tracer)
    assert kernels(tracer.snapshot()) == {"gemm": (1, pytest.approx(10e-6, rel=1e-2))}


def test_records_held_for_a_clock_never_measured_are_dropped_and_counted(
        cupti: FakeCupti) -> None:
    cupti.timestamp_follows_callback = False  # only the records could tell
    kineto_ran(cupti)
    world = World()
    tracer = real_tracer(world, cupti)
    world.tick(tracer)
    cupti.kernel("lone", 10_000)
    world.tick(tracer)
    world.tick(tracer)
    clock = tracer._record_clock
    assert clock is not None and clock.state == "unknown"
    tracer.stop()  # no baseline to measure its rate on: never counted in ticks as ns
    assert kernels(tracer.snapshot()) == {}
    assert clock.dropped_batches == 1
    assert tracer.snapshot()["unmeasured_batches"] == 1  # exported, not only kept
