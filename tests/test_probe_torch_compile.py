"""The probe beside ``torch.compile``: attaching to a job that trains a compiled
module writes nothing to its output (no warning about global module hooks), fires
each hook once a step, recompiles nothing, and leaves its weights as they would be."""

from __future__ import annotations

import gc
import time
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from dlprof_agent.probe.recorder import Recorder  # noqa: E402
from dlprof_agent.probe.torch_hooks import TorchHooks  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 12


def training(seed: int = 0) -> tuple[Any, Any]:
    """A compiled model (dynamo's eager backend: the wrapper and its guards, without
    a compiler's minutes) and one step of its training."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(model, backend="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    inputs, labels = torch.randn(32, 8), torch.randint(0, 4, (32,))

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(compiled(inputs), labels).backward()
        optimizer.step()

    return model, step


def test_a_compiled_module_is_hooked_without_a_warning_or_a_recompile() -> None:
    from torch._dynamo.utils import counters

    plain_model, plain_step = training()
    model, step = training()
    for _ in range(3):  # compiled before the probe comes, as in a running job
        plain_step()
        step()
    compiled_frames = dict(counters["stats"])
    recorder = Recorder(warmup_steps=0)
    hooks = TorchHooks(recorder, layers=False)
    calls = {"forward": 0}
    forward_started = hooks._forward_started

    def counted(*args: Any, **kwargs: Any) -> None:
        calls["forward"] += 1
        forward_started(*args, **kwargs)

    hooks._forward_started = counted  # type: ignore[method-assign]
    hooks.install()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(STEPS):
                plain_step()
                step()
    finally:
        hooks.remove()
    assert [str(warning.message) for warning in caught] == []
    assert hooks.model_name == "OptimizedModule"
    # Found on the second step's forward; hooked once, so called once a step from there.
    assert calls["forward"] == STEPS - 1
    assert dict(counters["stats"]) == compiled_frames, "the probe made dynamo compile again"
    snapshot = recorder.snapshot()
    assert snapshot["phase_split"] == "split" and snapshot["hook_errors"] == 0
    for plain, hooked in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(plain, hooked)


def compiled_step_training(seed: int = 0, timed: dict[str, float] | None = None,
                           ) -> tuple[Any, Any, Any]:
    """A train step whose forward and backward run in one compiled function, the
    optimizer's step after it (eager): the model's hooks never fire. ``timed`` adds up
    the step's own timer of each part, from outside the calls."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    inputs, labels = torch.randn(32, 8), torch.randint(0, 4, (32,))

    def forward_backward_eager(inputs: Any, labels: Any) -> Any:
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        return loss

    forward_backward = torch.compile(forward_backward_eager, backend="eager")

    def step() -> None:
        optimizer.zero_grad()
        started = time.perf_counter()
        forward_backward(inputs, labels)
        called = time.perf_counter()
        optimizer.step()
        if timed is not None:
            timed["compiled"] += called - started
            timed["optimizer"] += time.perf_counter() - called

    return model, step, forward_backward


def test_a_compiled_train_step_is_a_phase_without_a_warning_or_a_recompile() -> None:
    import threading

    from torch._dynamo.utils import counters

    from dlprof_agent.probe.torch_hooks import compile_context

    timed = {"compiled": 0.0, "optimizer": 0.0}
    plain_model, plain_step, plain_compiled = compiled_step_training(timed=timed)
    model, step, compiled = compiled_step_training(timed=timed)
    inputs, labels = torch.randn(32, 8), torch.randint(0, 4, (32,))
    for _ in range(3):
        plain_step()
        step()
    compiled_frames = dict(counters["stats"])
    context = compile_context(compiled)
    assert context is not None
    hooks_before = list(context.enter_exit_hooks)
    recorder = Recorder(warmup_steps=0)
    hooks = TorchHooks(recorder, layers=False)
    timed.update(compiled=0.0, optimizer=0.0)  # from the probe's coming on
    hooks.install()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(STEPS):
                plain_step()
                step()
            # A call off the training thread is no phase of its steps (the twin's too,
            # for the same gradients).
            for function in (plain_compiled, compiled):
                other = threading.Thread(target=function, args=(inputs, labels))
                other.start()
                other.join()
            written = hooks._events.written
            plain_step()  # the twin is a job of the same kind: its steps are stamped too
            step()
            # Each: the call's entry and exit, the optimizer's two; nothing else.
            assert hooks._events.written == written + 2 * 4
            frames_attached = dict(counters["stats"])
            # A new shape compiles again, with the probe in: it traces none of its hooks.
            for function in (plain_compiled, compiled):
                started = time.perf_counter()
                function(inputs[:5], labels[:5])
                timed["compiled"] += time.perf_counter() - started
    finally:
        hooks.remove()
    assert context.enter_exit_hooks == hooks_before, "the compile context keeps a hook"
    assert [str(warning.message) for warning in caught] == []
    assert frames_attached == compiled_frames, "the probe made dynamo compile again"
    snapshot = recorder.snapshot()
    assert snapshot["phase_split"] == "split" and snapshot["hook_errors"] == 0
    phases = snapshot["phase_seconds"]
    # Each part is a phase, and no phase holds more than the calls it stands for took
    # by the job's own timer (how the time splits between them is the machine's).
    assert 0 < phases["compiled"] <= timed["compiled"]
    assert 0 < phases["optimizer"] <= timed["optimizer"]
    assert "unsplit" not in phases and "forward" not in phases
    assert sum(phases.values()) == pytest.approx(snapshot["step_seconds_sum"])
    for plain, hooked in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(plain, hooked)


def test_a_module_compiled_after_the_probe_came_warns_nothing() -> None:
    """With ``run`` the hooks go in before the script compiles its model: discovery's
    global hook is then in while torch.compile(module)'s wrapper is called, which
    warns at each call about global hooks, unless the check leaves the probe's out.
    Another global hook is still counted, and the check is put back at the end."""
    from torch.nn.modules import module as module_module

    original_check = module_module._has_any_global_hook
    gc.collect()  # no compiled module of an earlier test left for install()'s scan
    recorder = Recorder(warmup_steps=0)
    hooks = TorchHooks(recorder, layers=False)
    hooks.install()  # before the model exists, as `run` installs them
    try:
        model, step = training()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(STEPS):
                step()
        theirs = module_module.register_module_forward_pre_hook(lambda module, args: None)
        try:
            # The job's own global hook counts.
            assert module_module._has_any_global_hook()  # type: ignore[no-untyped-call]
        finally:
            theirs.remove()
    finally:
        hooks.remove()
    assert [str(warning.message) for warning in caught] == []
    assert module_module._has_any_global_hook is original_check
    snapshot = recorder.snapshot()
    assert snapshot["phase_split"] == "split" and snapshot["hook_errors"] == 0
    assert snapshot["phase_seconds"]["forward"] > 0
    plain_model, plain_step = training()  # its twin, without the probe
    for _ in range(STEPS):
        plain_step()
    for plain, hooked in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(plain, hooked)


def test_a_function_compiled_after_the_probe_came_is_a_phase() -> None:
    """The train step compiled after the hooks went in: the first step that shows
    no training module has the compile contexts scanned for, and from there the
    compiled call is the step's phase."""
    gc.collect()  # no compiled function of an earlier test left for install()'s scan
    recorder = Recorder(warmup_steps=0)
    hooks = TorchHooks(recorder, layers=False)
    hooks.install()
    try:
        model, step, _compiled = compiled_step_training()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(STEPS):
                step()
    finally:
        hooks.remove()
    assert [str(warning.message) for warning in caught] == []
    snapshot = recorder.snapshot()
    assert snapshot["phase_split"] == "split" and snapshot["hook_errors"] == 0
    phases = snapshot["phase_seconds"]
    assert phases["compiled"] > phases["optimizer"] > 0
    assert "unsplit" not in phases and "forward" not in phases
    plain_model, plain_step, _ = compiled_step_training()  # its twin, without the probe
    for _ in range(STEPS):
        plain_step()
    for plain, hooked in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(plain, hooked)
