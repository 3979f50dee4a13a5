"""The PyTorch layer hooks' side of kernel attribution, on the CPU: what they push
to CUPTI's per-thread external correlation stacks, and the layer ranges they
give a trace window. CUPTI is a recording stand-in."""

from __future__ import annotations

import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # it imports torch

from dlprof_agent.probe.recorder import Recorder  # noqa: E402
from dlprof_agent.probe.torch_hooks import TorchHooks  # noqa: E402
from dlprof_agent.probe.trace_window import Capture  # noqa: E402
from tests.fake_cupti import RecordingCorrelator  # noqa: E402
from tests.test_probe_torch_hooks import Job, hooks_left  # noqa: E402

BASE = 3 << 24


class Tracer:
    """The part of KernelTracer the hooks read."""

    def __init__(self) -> None:
        self.correlator: Any = RecordingCorrelator(BASE)


def decode(external_id: int) -> tuple[int, int]:
    assert external_id >> 24 == 3
    local = external_id & ((1 << 24) - 1)
    return local >> 1, local & 1


def run(steps: int, *, tracer: Tracer | None) -> tuple[Job, TorchHooks, Recorder]:
    job = Job()
    recorder = Recorder(warmup_steps=0)
    hooks = TorchHooks(recorder, layers=True)
    hooks.kernels = tracer
    hooks.install()
    for _ in range(steps):
        job.step()
    return job, hooks, recorder


def test_each_layer_pushes_its_id_for_forward_and_backward_and_pops_it_again() -> None:
    tracer = Tracer()
    job, hooks, recorder = run(5, tracer=tracer)
    try:
        correlator = tracer.correlator
        assert hooks.layer_labels == [f"{index} {type(module).__name__}"
                                      for index, module in enumerate(job.model)]
        pushed = [decode(external) for call, external in correlator.calls if call == "push"]
        forward = {index for index, phase in pushed if phase == 0}
        backward = {index for index, phase in pushed if phase == 1}
        assert forward == set(range(10))
        assert backward == set(range(10))  # autograd reaches every layer's output here
        assert correlator.failures == 0  # never a pop on an empty stack
        assert all(not stack for stack in correlator.stacks.values())  # balanced per thread
        assert recorder.hook_errors == 0
    finally:
        hooks.remove()
    assert hooks_left(job) == 0


def test_nothing_is_pushed_while_cupti_is_not_ours() -> None:
    tracer = Tracer()
    tracer.correlator = None
    _job, hooks, recorder = run(4, tracer=tracer)
    hooks.remove()
    assert recorder.hook_errors == 0

    _job, hooks, recorder = run(4, tracer=None)  # no kernel tracer at all
    hooks.remove()
    assert recorder.hook_errors == 0


def test_a_correlator_that_goes_away_mid_step_leaves_no_stale_pop() -> None:
    tracer = Tracer()
    job, hooks, _recorder = run(3, tracer=tracer)
    first = tracer.correlator
    tracer.correlator = None  # the tracer yielded to torch.profiler
    job.step()
    tracer.correlator = RecordingCorrelator(BASE)  # and came back
    job.step()
    hooks.remove()
    assert first.failures == 0 and tracer.correlator.failures == 0
    assert all(not stack for stack in tracer.correlator.stacks.values())


def test_a_trace_window_gets_the_layer_ranges_and_the_steps() -> None:
    job, hooks, recorder = run(3, tracer=None)
    capture = Capture(2, time.monotonic() + 60, 0)
    recorder.capture = capture
    for _ in range(4):
        job.step()
    recorder.capture = None
    hooks.remove()

    assert capture.phase == "collecting" and len(capture.boundaries) == 3
    first, last = capture.boundaries[0], capture.boundaries[-1]
    phases = {(label, backward) for label, backward, _, _, _ in capture.layers}
    labels = [f"{index} {type(module).__name__}" for index, module in enumerate(job.model)]
    assert phases == {(label, b) for label in labels for b in (False, True)}
    for _, _, start, end, _ in capture.layers:
        assert first <= start <= end <= last
