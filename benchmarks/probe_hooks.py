"""The PyTorch hooks' cost per training step, as the probe installs them, on a
model of ten tiny layers whose compute is next to nothing: warm (hook_costs),
and with the caches swept between the step's phases (swept_split_costs)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import Progress

TINY_LAYERS = 10
# Hooks configurations: (split, layers). "steps" is the default, with the split.
HOOK_CONFIGS = {"no split": (False, False), "steps": (True, False), "layers": (True, True)}
SWEEP_BYTES = 8 << 20  # more than a core's L2 here (2 MiB): the next phase starts cold


def _median_step(model: Any, optimizer: Any, batch: Any, count: int, *,
                 before_optimizer: Callable[[], object] | None = None) -> float:
    durations = []
    for _ in range(count):
        started = time.perf_counter()
        optimizer.zero_grad()
        model(batch).sum().backward()
        if before_optimizer is not None:
            before_optimizer()
        optimizer.step()
        durations.append(time.perf_counter() - started)
    return statistics.median(durations[5:])  # hooks find the model in the first steps


def hook_costs(rounds: int, steps: int, progress: Progress) -> dict[str, list[float]]:
    """Extra wall seconds per training step over no hooks, per configuration and
    round, on TINY_LAYERS linear layers of 4 units."""
    import torch
    from torch import nn

    from dlprof_agent.probe.recorder import Recorder
    from dlprof_agent.probe.torch_hooks import TorchHooks

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(TINY_LAYERS)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.randn(2, 4)

    def median_step(count: int) -> float:
        return _median_step(model, optimizer, batch, count)

    median_step(max(steps, 100))
    costs: dict[str, list[float]] = {"off": [], **{config: [] for config in HOOK_CONFIGS},
                                     "torch.profiler": []}
    for index in range(rounds):
        off = median_step(steps)
        costs["off"].append(off)
        # Each round in another order, so that drift within a round cancels out.
        order = list(HOOK_CONFIGS)[index % len(HOOK_CONFIGS):] + list(
            HOOK_CONFIGS)[:index % len(HOOK_CONFIGS)]
        for config in order:
            split, layers = HOOK_CONFIGS[config]
            recorder = Recorder(warmup_steps=0)
            recorder.split = split
            hooks = TorchHooks(recorder, layers=layers, split=split)
            hooks.install()
            try:
                costs[config].append(median_step(steps) - off)
            finally:
                hooks.remove()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            costs["torch.profiler"].append(median_step(steps) - off)
        if index % max(1, rounds // 5) == 0 or index == rounds - 1:
            progress.advance(f"hooks, round {index + 1}/{rounds}: steps "
                             f"{costs['steps'][-1] * 1e6:.1f} µs, layers "
                             f"{costs['layers'][-1] * 1e6:.1f} µs per step")
    return costs


def swept_split_costs(rounds: int, steps: int, progress: Progress) -> dict[str, list[float]]:
    """What the step hooks add when every phase of the step leaves the caches
    cold, as a real model's compute does: the tiny model between two sweeps of
    SWEEP_BYTES (forward and backward), one more before the optimizer. Warm, the
    same hooks cost several times less (hook_costs), and that figure is not
    what a training job pays."""
    import torch
    from torch import nn

    from dlprof_agent.probe.recorder import Recorder
    from dlprof_agent.probe.torch_hooks import TorchHooks

    torch.manual_seed(0)
    torch.set_num_threads(1)
    buffer = torch.ones(SWEEP_BYTES // 4)

    class Sweep(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            buffer.sum()
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            buffer.sum()
            return grad

    class Swept(nn.Module):
        def forward(self, x: Any) -> Any:
            return Sweep.apply(x)  # type: ignore[no-untyped-call]

    model = nn.Sequential(Swept(), *[nn.Linear(4, 4) for _ in range(TINY_LAYERS)], Swept())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.randn(2, 4)

    def median_step(count: int) -> float:
        return _median_step(model, optimizer, batch, count, before_optimizer=buffer.sum)

    median_step(max(steps, 100))
    costs: dict[str, list[float]] = {"off": [], "no split": [], "steps": []}
    for index in range(rounds):
        off = median_step(steps)
        costs["off"].append(off)
        for split in ((True, False) if index % 2 == 0 else (False, True)):
            recorder = Recorder(warmup_steps=0)
            recorder.split = split
            hooks = TorchHooks(recorder, layers=False, split=split)
            hooks.install()
            try:
                costs["steps" if split else "no split"].append(median_step(steps) - off)
            finally:
                hooks.remove()
        if index % max(1, rounds // 5) == 0 or index == rounds - 1:
            progress.advance(f"hooks, caches swept, round {index + 1}/{rounds}: steps "
                             f"{costs['steps'][-1] * 1e6:.1f} µs per step")
    return costs
