"""The probe's aggregation and wire format, without a process around them."""

from __future__ import annotations

import socket
import struct
import time

import pytest

from dlprof_agent.errors import ConnectionClosed, ProtocolError
from dlprof_agent.probe.messages import OTHER
from dlprof_agent.probe.protocol import HEADER, MAGIC, encode, read_frame
from dlprof_agent.probe.recorder import (
    STEP_BUCKETS,
    LayerSampling,
    Recorder,
    priced,
)
from dlprof_agent.probe.session import DEFAULT_OPTIONS
from dlprof_agent.probe.session import checked_options as _options


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run_steps(recorder: Recorder, durations: list[float], source: str = "optimizer",
              samples: int = 8) -> None:
    clock = recorder.clock
    assert isinstance(clock, Clock)
    for duration in durations:
        recorder.add_samples(samples)
        clock.now += duration
        recorder.step_boundary(source)


def test_warmup_steps_stay_out_of_the_steady_figures() -> None:
    recorder = Recorder(warmup_steps=3, clock=Clock())
    recorder.step_boundary("optimizer")  # the first boundary only starts the clock
    run_steps(recorder, [5.0, 4.0, 3.0] + [0.02] * 20)
    snapshot = recorder.snapshot()
    assert snapshot["steps"] == {"warmup": 3, "steady": 20}
    assert snapshot["samples"] == {"warmup": 24, "steady": 160}
    assert snapshot["step_seconds_sum"] == pytest.approx(0.4)
    assert sum(snapshot["step_bucket_counts"]) == 20
    # 0.02 s falls in the bucket bounded by 0.025 s
    assert snapshot["step_bucket_counts"][STEP_BUCKETS.index(0.025)] == 20


def test_steps_stay_warm_up_until_the_hooks_have_found_the_model() -> None:
    """Until the model's hooks are in, a step's forward is not seen: such steps are
    warm-up however many pass, and a model found again later (hooks reinstalled)
    does not take a steady job back to warm-up."""
    recorder = Recorder(warmup_steps=2, clock=Clock())
    recorder.discovery_started()
    recorder.step_boundary("optimizer")
    run_steps(recorder, [0.5] * 5)
    assert recorder.snapshot()["steps"] == {"warmup": 5, "steady": 0}
    recorder.discovery_ended()
    run_steps(recorder, [0.02] * 3)
    assert recorder.snapshot()["steps"] == {"warmup": 5, "steady": 3}
    recorder.discovery_started()
    run_steps(recorder, [0.02] * 2)
    assert recorder.snapshot()["steps"] == {"warmup": 5, "steady": 5}


def test_a_stronger_step_source_takes_over_and_weaker_ones_are_ignored() -> None:
    recorder = Recorder(warmup_steps=0, clock=Clock())
    recorder.step_boundary("forward")
    run_steps(recorder, [1.0, 1.0], source="forward")
    assert recorder.snapshot()["steps"]["steady"] == 2
    recorder.step_boundary("optimizer")  # restarts the clock: no step counted
    run_steps(recorder, [0.5, 0.5, 0.5], source="optimizer")
    run_steps(recorder, [9.0], source="forward")  # ignored, and so are its samples' timing
    snapshot = recorder.snapshot()
    assert snapshot["step_source"] == "optimizer"
    assert snapshot["steps"]["steady"] == 5
    assert snapshot["step_seconds_sum"] == pytest.approx(3.5)


def test_phases_add_up_to_the_step_time() -> None:
    recorder = Recorder(warmup_steps=0, clock=Clock())
    recorder.step_boundary("optimizer")
    for _ in range(4):
        recorder.add_phase_time("forward", 0.2)
        recorder.add_phase_time("backward", 0.3)
        recorder.add_phase_time("optimizer", 0.1)
        run_steps(recorder, [1.0])
    snapshot = recorder.snapshot()
    phases = snapshot["phase_seconds"]
    assert phases == pytest.approx({"forward": 0.8, "backward": 1.2, "optimizer": 0.4,
                                    "other": 1.6})
    assert sum(phases.values()) == pytest.approx(snapshot["step_seconds_sum"])
    assert snapshot["phase_split"] == "split"


def test_layer_names_are_capped_with_an_other_bucket() -> None:
    recorder = Recorder(warmup_steps=0, max_layers=4, clock=Clock())
    recorder.step_boundary("optimizer")
    for index in range(10):
        recorder.add_layer_time(f"layer{index}", "forward", 1.0)
    run_steps(recorder, [1.0])
    layers = {row[0]: row[1:] for row in recorder.snapshot()["layers"]}
    assert set(layers) == {"layer0", "layer1", "layer2", "layer3", OTHER}
    assert layers[OTHER] == [6.0, 6, 0.0, 0]


def test_layers_are_not_counted_during_warmup() -> None:
    recorder = Recorder(warmup_steps=2, clock=Clock())
    recorder.step_boundary("optimizer")
    recorder.add_layer_time("conv", "forward", 1.0)
    run_steps(recorder, [1.0, 1.0])
    recorder.add_layer_time("conv", "forward", 0.5)
    run_steps(recorder, [1.0])
    assert recorder.snapshot()["layers"] == [["conv", 0.5, 1, 0.0, 0]]


def timed_steps(recorder: Recorder, steps: int, *, step: float, cost: float,
                after: float = 0.0) -> list[bool]:
    """Steps of ``step`` seconds, ``cost`` more when timed and ``after`` more in the
    step after a timed one (the hooks taken out), each timed one with a 0.2 s forward
    and 0.3 s backward in ``conv``; which steps were timed."""
    clock = recorder.clock
    assert isinstance(clock, Clock)
    timed: list[bool] = []
    for _ in range(steps):
        follows = bool(timed) and timed[-1]
        timed.append(recorder.layer_step)
        if recorder.layer_step:
            recorder.add_layer_time("conv", "forward", 0.2 * step)
            recorder.add_layer_time("conv", "backward", 0.3 * step)
        clock.now += step + (cost if recorder.layer_step else 0.0) + (after if follows else 0.0)
        recorder.step_boundary("optimizer")
    return timed


def test_a_fixed_rate_times_one_step_in_n_and_scales_to_all_steps() -> None:
    recorder = Recorder(warmup_steps=2, clock=Clock(), layer_sampling=LayerSampling(every=4))
    recorder.step_boundary("optimizer")
    timed = timed_steps(recorder, 2 + 40, step=1.0, cost=0.0)
    assert timed[:2] == [False, False]  # warm-up
    assert timed[2:] == [False, False, False, True] * 10
    snapshot = recorder.snapshot()
    assert snapshot["layer_sampled_steps"] == 10
    # Each timed step stands for four: the estimate covers all 40 steady steps.
    assert snapshot["layers"] == [["conv", pytest.approx(8.0), 40, pytest.approx(12.0), 40]]
    # Layer times are not phases: hooks time the phases themselves (test_phase_split.py).
    assert sum(snapshot["phase_seconds"].values()) == pytest.approx(snapshot["step_seconds_sum"])


@pytest.mark.parametrize(("budget", "cost", "interval"), [
    (0.01, 0.05, 5), (0.01, 0.2, 20), (0.001, 0.05, 50), (0.05, 0.05, 5)])
def test_the_budget_sets_how_often_steps_are_timed(budget: float, cost: float,
                                                   interval: int) -> None:
    """A timed step costing ``cost`` of a step, under ``budget``: one step in
    cost / budget is timed, so timing adds ``budget`` of the step time."""
    sampling = LayerSampling(budget=budget)
    recorder = Recorder(warmup_steps=0, clock=Clock(), layer_sampling=sampling)
    recorder.step_boundary("optimizer")
    timed_steps(recorder, 40 * interval, step=1.0, cost=cost)  # learns the cost
    assert sampling.interval == interval
    assert sampling.cost_ratio == pytest.approx(cost)
    timed = timed_steps(recorder, 20 * interval, step=1.0, cost=cost)
    assert sum(timed) == pytest.approx(20, abs=1)
    added = sum(timed) * cost / (20 * interval)
    assert added <= budget * 1.05


def test_the_layer_part_of_the_probes_cost_is_what_timed_steps_added() -> None:
    sampling = LayerSampling(budget=0.01)
    recorder = Recorder(warmup_steps=0, clock=Clock(), layer_sampling=sampling)
    recorder.step_boundary("optimizer")
    timed = timed_steps(recorder, 400, step=1.0, cost=0.05)
    # Each timed step added 0.05 s over the untimed ones before it.
    assert recorder.cpu_seconds()["layers"] == pytest.approx(0.05 * sum(timed))
    assert "layers" not in Recorder(warmup_steps=0).cpu_seconds()  # no layer timing


def test_what_taking_the_layer_hooks_out_costs_the_next_step_is_priced_too() -> None:
    """The step after a timed one pays for taking the hooks out (and for the caches
    they left): the duty cycle counts it with the timed step, so a budget of 1% holds
    for what the job pays, not only for the timed steps."""
    sampling = LayerSampling(budget=0.01)
    recorder = Recorder(warmup_steps=0, clock=Clock(), layer_sampling=sampling)
    recorder.step_boundary("optimizer")
    timed_steps(recorder, 2000, step=1.0, cost=0.03, after=0.02)
    assert sampling.cost_ratio == pytest.approx(0.05)
    assert sampling.interval == 5
    timed = timed_steps(recorder, 1000, step=1.0, cost=0.03, after=0.02)
    assert sum(timed) * 0.05 / 1000 <= 0.01 * 1.05


def test_a_timed_steps_cost_that_varies_is_priced_by_its_mean() -> None:
    """One timed step in three also pays a collection: a median would price the cheap
    two and time steps three times as often as 1% allows; the mean keeps the budget."""
    sampling = LayerSampling(budget=0.01)
    recorder = Recorder(warmup_steps=0, clock=Clock(), layer_sampling=sampling)
    recorder.step_boundary("optimizer")
    clock = recorder.clock
    assert isinstance(clock, Clock)
    added = 0.0
    timed = 0
    for index in range(6000):
        cost = 0.0
        if recorder.layer_step:
            timed += 1
            cost = 0.14 if timed % 3 == 0 else 0.02
            if index >= 3000:  # past learning
                added += cost
        clock.now += 1.0 + cost
        recorder.step_boundary("optimizer")
    assert sampling.interval >= 5
    assert added / 3000 <= 0.01 * 1.1


class Hooks:
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    @priced
    def spin(self, seconds: float) -> str:
        """Busy for ``seconds``."""
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            pass
        return "done"

    @priced
    def fail(self) -> None:
        raise RuntimeError("a hook bug")


def test_a_priced_hook_adds_its_time_and_keeps_its_result_and_name() -> None:
    recorder = Recorder(warmup_steps=0, clock=Clock())  # a fake clock: pricing ignores it
    hooks = Hooks(recorder)
    started = time.perf_counter()
    assert [hooks.spin(0.002) for _ in range(5)] == ["done"] * 5
    elapsed = time.perf_counter() - started
    assert 0.010 <= recorder.hook_seconds <= elapsed
    with pytest.raises(RuntimeError):
        hooks.fail()  # priced on the way out too
    assert recorder.cpu_seconds() == {"hooks": recorder.hook_seconds}
    assert Hooks.spin.__name__ == "spin" and Hooks.spin.__doc__ == "Busy for ``seconds``."


def test_a_resumed_recorder_does_not_count_the_pause_as_a_step() -> None:
    clock = Clock()
    recorder = Recorder(warmup_steps=0, clock=clock)
    recorder.step_boundary("optimizer")
    run_steps(recorder, [1.0, 1.0])
    clock.now += 500.0  # paused: no hook ran
    recorder.resume()
    recorder.step_boundary("optimizer")
    run_steps(recorder, [1.0])
    snapshot = recorder.snapshot()
    assert snapshot["steps"]["steady"] == 3
    assert snapshot["step_seconds_sum"] == pytest.approx(3.0)


def test_without_duty_cycle_every_step_counts_and_no_sampled_count_is_told() -> None:
    recorder = Recorder(warmup_steps=0, clock=Clock())
    recorder.step_boundary("optimizer")
    for _ in range(3):
        recorder.add_layer_time("conv", "forward", 0.5)
        run_steps(recorder, [1.0])
    snapshot = recorder.snapshot()
    assert snapshot["layers"] == [["conv", 1.5, 3, 0.0, 0]]
    assert "layer_sampled_steps" not in snapshot


def test_frames_round_trip_and_bad_frames_are_named() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.sendall(encode({"command": "snapshot"}))
        assert read_frame(right, max_bytes=1024) == {"command": "snapshot"}

        left.sendall(b"GET / HTTP/1.1\r\n\r\n")
        with pytest.raises(ProtocolError) as error:
            read_frame(right, max_bytes=1024)
        assert error.value.reason == "malformed"

    cases = {
        "oversized": HEADER.pack(MAGIC, 1, 10_000_000),
        "version": HEADER.pack(MAGIC, 99, 2) + b"{}",
        "malformed": HEADER.pack(MAGIC, 1, 4) + b"[1] ",
    }
    for reason, frame in cases.items():
        left, right = socket.socketpair()
        with left, right:
            left.sendall(frame)
            with pytest.raises(ProtocolError) as error:
                read_frame(right, max_bytes=1024)
            assert error.value.reason == reason

    left, right = socket.socketpair()
    with right:
        left.sendall(struct.pack("!4s", MAGIC))  # a header cut short
        left.close()
        with pytest.raises(ConnectionClosed):
            read_frame(right, max_bytes=1024)


@pytest.mark.parametrize("args", [
    {"layers": "yes"}, {"warmup_steps": True}, {"warmup_steps": -1},
    {"interval_seconds": 0}, {"max_layers": 10**9}, {"evil": "__import__('os')"}, [1, 2],
])
def test_bad_command_arguments_are_rejected(args: object) -> None:
    with pytest.raises(ValueError):
        _options(args, DEFAULT_OPTIONS)


def test_good_command_arguments_are_merged() -> None:
    options = _options({"layers": True, "warmup_steps": 3, "interval_seconds": 0.5},
                       DEFAULT_OPTIONS)
    assert options["layers"] is True
    assert options["warmup_steps"] == 3
    assert options["max_layers"] == DEFAULT_OPTIONS["max_layers"]


def test_a_trace_window_times_the_layers_of_warm_up_steps_too() -> None:
    # `dlprof-agent trace` on a job with no agent opens a fresh session, whose first
    # steps are warm-up: its window came out with steps only, no layers or kernels.
    from dlprof_agent.probe.trace_window import Capture

    recorder = Recorder(warmup_steps=10, layer_sampling=LayerSampling())
    recorder.step_boundary("optimizer", now=1.0)
    recorder.step_boundary("optimizer", now=2.0)
    assert not recorder.layer_step  # warm-up: layers are not timed
    recorder.capture = Capture(2, deadline=1e9, offset_ns=0)
    recorder.step_boundary("optimizer", now=3.0)
    assert recorder.layer_step and recorder.steps["warmup"] == 2


def test_a_step_mark_during_the_probes_own_import_is_dropped_not_raised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An injection imports the runtime on the probe's thread while the job marks
    steps: the job may meet half a module, or a ``current`` that fails."""
    import sys
    import types

    from dlprof_agent import probe

    half = types.ModuleType(probe._RUNTIME)  # no ``current`` yet
    monkeypatch.setitem(sys.modules, probe._RUNTIME, half)
    probe.step(32)

    def broken() -> None:
        raise NameError("_probe")

    half.current = broken  # type: ignore[attr-defined]
    probe.step(32)
