"""The default split's hot path: four stamps a step into a ring, replayed in order by
the recorder, off the job's thread or before anything that adds to it directly."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from dlprof_agent.probe.recorder import Recorder
from dlprof_agent.probe.torch_steps import (
    CLOSURE_ENDED,
    CLOSURE_STARTED,
    COMPILED_ENDED,
    COMPILED_STARTED,
    FORWARD_ENDED,
    FORWARD_STARTED,
    OPTIMIZER_ENDED,
    OPTIMIZER_STARTED,
    StepEvents,
)


def recorder_with(events: StepEvents) -> Recorder:
    recorder = Recorder(warmup_steps=0)
    recorder.events = events
    return recorder


def stamp_step(events: StepEvents, start: float, *, closure: bool = False,
               samples: int = 8) -> float:
    """One optimizer step of 10 s stamped as the hooks stamp it: forward 2 s, backward
    (the loss included) 5 s, optimizer 1 s, and 2 s before the forward. With a closure
    the optimizer's pre-hook comes first and the closure holds forward and backward."""
    if closure:
        events.stamp(OPTIMIZER_STARTED, start)
        events.stamp(CLOSURE_STARTED, start)
    events.stamp(FORWARD_STARTED, start + 2, samples)
    events.stamp(FORWARD_ENDED, start + 4, 1.0)
    if closure:
        events.stamp(CLOSURE_ENDED, start + 9)
    else:
        events.stamp(OPTIMIZER_STARTED, start + 9)
    events.stamp(OPTIMIZER_ENDED, start + 10, 1.0)
    return start + 10


def test_stamps_replayed_at_the_snapshot_split_each_step() -> None:
    events = StepEvents(slots=64)
    recorder = recorder_with(events)
    now = stamp_step(events, 0.0)  # the first boundary only starts the clock
    for _ in range(3):
        now = stamp_step(events, now)
    assert events.pending()
    snapshot = recorder.snapshot()
    assert not events.pending()
    assert snapshot["steps"]["steady"] == 3 and snapshot["samples"]["steady"] == 24
    assert snapshot["step_seconds_sum"] == pytest.approx(30.0)
    # The 2 s before each forward belong to the step they open: other.
    assert snapshot["phase_seconds"] == pytest.approx(
        {"forward": 6.0, "backward": 15.0, "optimizer": 3.0, "other": 6.0})
    assert snapshot["phase_split"] == "split"


def test_a_closure_ends_backward_and_its_own_time_is_other() -> None:
    events = StepEvents(slots=64)
    recorder = recorder_with(events)
    now = stamp_step(events, 0.0, closure=True)
    for _ in range(2):
        now = stamp_step(events, now, closure=True)
    phases = recorder.snapshot()["phase_seconds"]
    # Per step: the closure's 9 s less forward and backward is other (2 s), and the
    # optimizer keeps only the 1 s after the closure.
    assert phases == pytest.approx({"forward": 4.0, "backward": 10.0, "optimizer": 2.0,
                                    "other": 4.0})


def test_a_direct_addition_replays_the_stamps_before_it() -> None:
    """A collective's wait inside the backward is taken out of it: the recorder replays
    the forward's end before it adds the wait, so the wait lands inside the backward."""
    events = StepEvents(slots=64)
    recorder = recorder_with(events)
    now = stamp_step(events, 0.0)
    events.stamp(FORWARD_STARTED, now + 2, 8)
    events.stamp(FORWARD_ENDED, now + 4, 1.0)
    mark = recorder.phase_mark()  # as CollectiveTiming does, on the job's thread
    assert not events.pending()
    recorder.add_phase_time("exchange", 3.0, since=mark)
    events.stamp(OPTIMIZER_STARTED, now + 9)
    events.stamp(OPTIMIZER_ENDED, now + 10, 1.0)
    phases = recorder.snapshot()["phase_seconds"]
    assert phases["exchange"] == pytest.approx(3.0)
    assert phases["backward"] == pytest.approx(2.0)  # 5 s less the 3 s inside it


def stamp_compiled_step(events: StepEvents, start: float) -> float:
    """One step of 10 s whose forward and backward run in one compiled call (7 s,
    from 2 s), the optimizer's step 1 s after it: no forward hook fires."""
    events.stamp(COMPILED_STARTED, start + 2, 8)
    events.stamp(COMPILED_ENDED, start + 9, 1.0)
    events.stamp(OPTIMIZER_STARTED, start + 9.5)
    events.stamp(OPTIMIZER_ENDED, start + 10, 1.0)
    return start + 10


def test_a_compiled_train_step_is_split_around_its_call() -> None:
    events = StepEvents(slots=64)
    recorder = recorder_with(events)
    now = stamp_compiled_step(events, 0.0)
    for _ in range(3):
        now = stamp_compiled_step(events, now)
    snapshot = recorder.snapshot()
    assert snapshot["phase_split"] == "split" and snapshot["samples"]["steady"] == 3 * 8
    # Per step: the call 7 s, backward derived from its end to the optimizer 0.5 s
    # (a backward run after the call would be there), the optimizer 0.5 s, the rest other.
    assert snapshot["phase_seconds"] == pytest.approx(
        {"compiled": 21.0, "backward": 1.5, "optimizer": 1.5, "other": 6.0})


def test_compiled_calls_inside_a_phase_are_that_phases() -> None:
    """A compiled loss after the forward, a compiled block inside it, and one compiled
    call nested in another: none is a phase of its own, and the nesting is counted."""
    events = StepEvents(slots=64)
    recorder = recorder_with(events)
    now = stamp_step(events, 0.0)
    events.stamp(FORWARD_STARTED, now + 2, 8)
    events.stamp(COMPILED_STARTED, now + 2.5)  # inside the forward
    events.stamp(COMPILED_ENDED, now + 3, 1.0)
    events.stamp(FORWARD_ENDED, now + 4, 1.0)
    events.stamp(COMPILED_STARTED, now + 4.5)  # the loss, inside the derived backward
    events.stamp(COMPILED_ENDED, now + 5, 1.0)
    events.stamp(OPTIMIZER_STARTED, now + 9)
    events.stamp(OPTIMIZER_ENDED, now + 10, 1.0)
    now += 10
    events.stamp(COMPILED_STARTED, now + 1, 8)  # a whole step in one call, nesting
    events.stamp(COMPILED_STARTED, now + 2, 8)  # another, and an eager forward that
    events.stamp(COMPILED_ENDED, now + 3, 1.0)  # counts the samples itself
    events.stamp(FORWARD_STARTED, now + 4, 8)
    events.stamp(FORWARD_ENDED, now + 5, 0.0)
    events.stamp(COMPILED_ENDED, now + 8, 1.0)
    events.stamp(OPTIMIZER_STARTED, now + 9)
    events.stamp(OPTIMIZER_ENDED, now + 10, 1.0)
    snapshot = recorder.snapshot()
    assert snapshot["samples"]["steady"] == 8 + 8
    assert snapshot["phase_seconds"] == pytest.approx(
        {"forward": 2.0 + 1.0, "backward": 5.0 + 1.0, "optimizer": 2.0, "compiled": 6.0,
         "other": 2.0 + 1.0})


def test_a_second_forward_in_a_step_is_told_to_the_hooks() -> None:
    """Gradient accumulation: backward's end cannot be derived from the optimizer's
    start; the replay says so, and the hooks then mark backward themselves."""
    events = StepEvents(slots=64)
    recorder = recorder_with(events)
    events.stamp(FORWARD_STARTED, 0.0, 8)
    events.stamp(FORWARD_ENDED, 1.0, 1.0)
    events.stamp(FORWARD_STARTED, 3.0, 8)
    recorder.drain()
    assert events.several_forwards


def test_a_ring_lapped_before_its_replay_loses_the_oldest_and_restarts_the_steps() -> None:
    events = StepEvents(slots=8)
    recorder = recorder_with(events)
    now = 0.0
    for _ in range(6):  # 24 events in 8 slots
        now = stamp_step(events, now)
    snapshot = recorder.snapshot()
    assert events.lost == 24 - 8
    # What was left began mid-step: no step was made of the gap.
    assert snapshot["step_seconds_sum"] <= 10.0 + 1e-9
    now = stamp_step(events, now)
    assert recorder.snapshot()["step_seconds_sum"] == pytest.approx(
        snapshot["step_seconds_sum"] + 10.0)


def test_a_replay_on_another_thread_never_calls_the_layer_listeners() -> None:
    """Layer hooks change a module's hook tables: only the job's thread may, between
    two calls of the module; a replay on the probe's thread leaves that to it."""
    events = StepEvents(slots=64)
    recorder = recorder_with(events)
    told: list[tuple[bool, str]] = []
    recorder.layer_listeners.append(
        lambda timed: told.append((timed, threading.current_thread().name)))
    stamp_step(events, stamp_step(events, 0.0))
    replay = threading.Thread(target=recorder.snapshot, name="probe")
    replay.start()
    replay.join()
    assert recorder.snapshot()["steps"]["steady"] == 1 and told == []
    recorder.tell_layer_listeners()  # what the optimizer's hook does after its drain
    # No duty cycle: every steady step is timed.
    assert told == [(True, threading.current_thread().name)]


@pytest.mark.slow  # imports torch
def test_a_steady_step_calls_four_hooks_and_registers_nothing() -> None:
    """The imagenet example's loop: every steady step calls the four stamping hooks
    once each, and nothing on autograd's nodes or its engine's callbacks."""
    torch = pytest.importorskip("torch")
    from dlprof_agent.probe.torch_hooks import TorchHooks

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, labels = torch.randn(16, 4), torch.randint(0, 2, (16,))

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()

    recorder = Recorder(warmup_steps=0)
    hooks = TorchHooks(recorder, layers=False)
    calls: dict[str, int] = {}
    for name in ("_forward_started", "_forward_ended", "_optimizer_started",
                 "_optimizer_ended", "_backward_started_hook", "_backward_ended",
                 "_discover"):
        setattr(hooks, name, _counted(getattr(hooks, name), name, calls))
    hooks.install()
    try:
        for _ in range(4):  # the model found, the first optimizer known
            step()
        calls.clear()
        for _ in range(10):
            step()
    finally:
        hooks.remove()
    assert calls == {"_forward_started": 10, "_forward_ended": 10,
                     "_optimizer_started": 10, "_optimizer_ended": 10}
    snapshot = recorder.snapshot()
    assert snapshot["phase_split"] == "split" and snapshot["samples"]["steady"] >= 10 * 16
    assert snapshot["hook_errors"] == 0


@pytest.mark.slow  # imports torch
def test_hooks_that_arrive_mid_step_split_every_steady_step() -> None:
    """Hooks installed between a step's backward and its optimizer step (an attach
    lands anywhere) meet the optimizer's end before any forward: with no warm-up
    asked for, the steps before the model's hooks are in are still warm-up, so no
    steady step is left unsplit."""
    torch = pytest.importorskip("torch")
    from dlprof_agent.probe.torch_hooks import TorchHooks

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, labels = torch.randn(16, 4), torch.randint(0, 2, (16,))
    recorder = Recorder(warmup_steps=0)
    hooks = TorchHooks(recorder, layers=False)
    try:
        for step in range(8):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(inputs), labels).backward()
            if step == 0:
                hooks.install()
            optimizer.step()
    finally:
        hooks.remove()
    snapshot = recorder.snapshot()
    assert snapshot["steps"]["warmup"] >= 1 and snapshot["steps"]["steady"] >= 5
    assert "unsplit" not in snapshot["phase_seconds"]
    assert snapshot["phase_split"] == "split"


@pytest.mark.slow  # imports torch
def test_a_loop_with_no_training_module_still_reaches_steady_steps() -> None:
    """An optimizer over bare tensors: no module to find, so discovery ends after a
    whole step without one, and the steps are steady (not split) rather than warm-up
    for ever."""
    torch = pytest.importorskip("torch")
    from dlprof_agent.probe.torch_hooks import TorchHooks

    weight = torch.zeros(4, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.01)
    recorder = Recorder(warmup_steps=1)
    hooks = TorchHooks(recorder, layers=False)
    hooks.install()
    try:
        for _ in range(8):
            optimizer.zero_grad()
            (weight * torch.ones(4)).sum().backward()
            optimizer.step()
    finally:
        hooks.remove()
    snapshot = recorder.snapshot()
    assert snapshot["steps"]["steady"] >= 5 and not recorder.discovering
    assert snapshot["phase_split"] == "forward not seen"


def _counted(hook: Any, name: str, calls: dict[str, int]) -> Any:
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] = calls.get(name, 0) + 1
        return hook(*args, **kwargs)
    return counted
