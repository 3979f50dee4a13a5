"""The probe beside ``torch.compile``: attaching to a job that trains a compiled
module writes nothing to its output (no warning about global module hooks), fires
each hook once a step, recompiles nothing, and leaves its weights as they would be."""

from __future__ import annotations

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
