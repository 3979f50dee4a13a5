"""The PyTorch hooks in this process: finding the model whenever the probe
arrives, timing layers, and leaving nothing behind."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # it imports torch

from dlprof_agent.probe.recorder import Recorder  # noqa: E402
from dlprof_agent.probe.torch_hooks import TorchHooks  # noqa: E402
from dlprof_agent.workloads.torch_models import small_cnn  # noqa: E402

BATCH = 8


class Job:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = small_cnn()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.images = torch.randn(BATCH, 3, 32, 32)
        self.labels = torch.randint(0, 10, (BATCH,))

    def step(self) -> None:
        self.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(self.model(self.images), self.labels).backward()
        self.optimizer.step()


def hooks_left(job: Job) -> int:
    from torch.nn.modules import module
    from torch.optim import optimizer

    return (sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in job.model.modules())
            + len(module._global_forward_pre_hooks) + len(module._global_forward_hooks)
            + len(optimizer._global_optimizer_pre_hooks)
            + len(optimizer._global_optimizer_post_hooks))


@pytest.mark.parametrize("arrive_at", [None, "7", "9"])
def test_the_model_is_found_even_when_the_probe_arrives_mid_forward(
        arrive_at: str | None) -> None:
    job = Job()
    recorder = Recorder(warmup_steps=1)
    hooks = TorchHooks(recorder, layers=True)
    if arrive_at is None:
        hooks.install()
    else:  # as an injected probe may: while the model is halfway through its forward
        layer = dict(job.model.named_modules())[arrive_at]
        handle = layer.register_forward_pre_hook(lambda module, args: hooks.install())
        job.step()
        handle.remove()
    try:
        for _ in range(6):
            job.step()
        assert hooks.model_name == "Sequential"
        snapshot = recorder.snapshot()
        names = {row[0] for row in snapshot["layers"]}
        assert names == {"0 Conv2d", "1 ReLU", "2 MaxPool2d", "3 Conv2d", "4 ReLU",
                         "5 MaxPool2d", "6 Flatten", "7 Linear", "8 ReLU", "9 Linear"}
        assert snapshot["samples"]["steady"] == BATCH * snapshot["steps"]["steady"]
        assert snapshot["step_source"] == "optimizer"
    finally:
        hooks.remove()
    assert hooks_left(job) == 0


def test_layer_time_covers_most_of_the_step_and_phases_add_up() -> None:
    job = Job()
    recorder = Recorder(warmup_steps=3)
    hooks = TorchHooks(recorder, layers=True)
    hooks.install()
    for _ in range(30):
        job.step()
    hooks.remove()
    snapshot = recorder.snapshot()
    phases = snapshot["phase_seconds"]
    assert sum(phases.values()) == pytest.approx(snapshot["step_seconds_sum"])
    layers = phases["forward"] + phases["backward"]
    assert layers <= snapshot["step_seconds_sum"]
    forward_calls = {row[0]: row[2] for row in snapshot["layers"]}
    backward_calls = {row[0]: row[4] for row in snapshot["layers"]}
    steady = snapshot["steps"]["steady"]
    # Forward: every leaf, every steady step. Backward: every leaf whose output
    # autograd reaches (all of them here), once per step.
    assert set(forward_calls.values()) == {steady}
    assert set(backward_calls.values()) == {steady}


def test_a_failing_hook_is_counted_and_training_goes_on() -> None:
    class Broken(TorchHooks):
        def _hook_output(self, output: Any, node: Any, hook: Any) -> None:
            raise RuntimeError("broken on purpose")

    job = Job()
    recorder = Recorder(warmup_steps=0)
    hooks = Broken(recorder, layers=True)
    hooks.install()
    before = [p.detach().clone() for p in job.model.parameters()]
    for _ in range(3):
        job.step()
    hooks.remove()
    assert recorder.hook_errors > 0
    assert "layer_forward" in recorder.hook_error_kinds
    after = list(job.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_inplace_activations_and_tuple_outputs_are_not_disturbed() -> None:
    model: Any = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(inplace=True),
                                     torch.nn.Linear(4, 2))
    lstm = torch.nn.LSTM(2, 3)
    optimizer = torch.optim.SGD([*model.parameters(), *lstm.parameters()], lr=0.1)
    recorder = Recorder(warmup_steps=0)
    hooks = TorchHooks(recorder, layers=True)
    hooks.install()
    for _ in range(4):
        optimizer.zero_grad()
        output, _state = lstm(model(torch.randn(5, 1, 4)))
        output.sum().backward()
        optimizer.step()
    hooks.remove()
    assert recorder.hook_errors == 0, recorder.hook_error_kinds


def test_the_jobs_own_hooks_on_a_layers_output_run_come_off_and_pickle_quietly() -> None:
    """The layer hooks ride on the output's hook dict, as Tensor.register_hook's own
    do: a hook the job then adds to that output runs once a backward and comes off
    with its handle, and pickling the output (torch.save does) says nothing about
    the probe's hook."""
    import pickle
    import warnings

    job = Job()
    seen: list[int] = []
    recorder = Recorder(warmup_steps=0)
    hooks = TorchHooks(recorder, layers=True)
    hooks.install()
    try:
        for _ in range(6):  # the model's output is its last leaf's, which is timed
            job.optimizer.zero_grad()
            logits = job.model(job.images)
            handle = logits.register_hook(lambda grad: seen.append(grad.shape[0]))
            torch.nn.functional.cross_entropy(logits, job.labels).backward()
            job.optimizer.step()
            handle.remove()  # the job's own handle takes only its own hook
        timed = {row[0] for row in recorder.snapshot()["layers"] if row[4] > 0}
        last = list(job.model.named_modules())[-1][0]
        assert any(label.startswith(f"{last} ") for label in timed)  # the probe's ran too
        assert len(logits._backward_hooks) == 1  # the probe's, after the job's came off
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "backward hook ... will not be serialized"
            pickle.dumps(logits)
    finally:
        hooks.remove()
    assert seen == [BATCH] * 6
    assert recorder.hook_errors == 0, recorder.hook_error_kinds


def test_a_paused_session_takes_every_hook_out_and_keeps_its_totals() -> None:
    import socket

    from dlprof_agent.probe.session import DEFAULT_OPTIONS, Session, checked_options

    job = Job()
    clock = SteppedClock()  # the steps' and the pause's lengths, whatever the load
    left, right = socket.socketpair()
    with left, right:
        session = Session(left, 1, 0, checked_options(
            {"warmup_steps": 0, "layers": True, "layers_every": 2}, DEFAULT_OPTIONS))
        session.recorder.clock = clock  # before the hooks, which take it when made
        errors: dict[str, int] = {}
        session.install_new_hooks(errors)
        clock.steps(job, 8)
        before = session.recorder.snapshot()
        priced = session.cpu_seconds()["hooks"]
        assert before["steps"]["steady"] >= 6 and priced > 0

        session.reconfigure(checked_options({"paused": True}, session.options()), errors)
        assert hooks_left(job) == 0
        session.install_new_hooks(errors)  # as every snapshot does: not while paused
        assert hooks_left(job) == 0
        clock.steps(job, 5)
        clock.now += 100.0  # a pause longer than any step
        assert session.recorder.snapshot()["steps"] == before["steps"]
        assert session.cpu_seconds()["hooks"] == priced

        session.reconfigure(checked_options({"paused": False}, session.options()), errors)
        clock.steps(job, 8)
        after = session.recorder.snapshot()
        assert after["steps"]["steady"] >= before["steps"]["steady"] + 5
        assert after["layer_sampled_steps"] > before["layer_sampled_steps"]
        # The pause is no step: none as long as it was counted.
        assert after["step_buckets"] == before["step_buckets"]
        assert _steps_over(after, 0.25) == _steps_over(before, 0.25) == 0
        assert session.cpu_seconds()["hooks"] > priced
        assert errors == {} and after["hook_errors"] == 0
        session.remove_hooks()
    assert hooks_left(job) == 0


class SteppedClock:
    """The recorder's clock, moved by the test: each step takes STEP_SECONDS."""

    STEP_SECONDS = 0.01

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def steps(self, job: Job, count: int) -> None:
        for _ in range(count):
            self.now += self.STEP_SECONDS
            job.step()


def _steps_over(snapshot: Any, seconds: float) -> int:
    """Steps in the buckets that start at ``seconds`` or later."""
    bounds, counts = snapshot["step_buckets"], snapshot["step_bucket_counts"]
    return sum(count for index, count in enumerate(counts)
               if index > 0 and bounds[index - 1] >= seconds)
