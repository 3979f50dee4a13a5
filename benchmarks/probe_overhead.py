"""The probe's cost to a training job: step time with the probe attached (step
timing only, and with --layers) against no probe, and torch.profiler with CPU
activities for comparison, on a small CNN on the CPU.

One job process runs blocks of steps; the configurations take turns block by
block, so drift of the machine hits them all alike. Before a probe block this
script connects to the job's probe as an agent would (and polls a snapshot
every second); after it, it says stop, which removes the hooks. Each ratio is
a block's median step time over the median of the no-probe block of the same
round; the table gives the median, min and max over rounds.

    python benchmarks/probe_overhead.py --rounds 20 --block-steps 100
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("off", "steps", "layers", "torch.profiler")
JOB_WARMUP_STEPS = 50
SETTLE_STEPS = 5  # a block's first steps: the probe finds the model, the profiler starts


def job(batch: int, threads: int) -> int:
    """The training job: runs a block of steps per line read, prints their times."""
    import torch

    import dlprof_agent.probe
    from dlprof_agent.workloads.torch_models import small_cnn

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    dlprof_agent.probe.enable()  # dormant until the benchmark connects
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    images, labels = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))

    def step() -> None:
        optimizer.zero_grad()
        loss_fn(model(images), labels).backward()
        optimizer.step()

    for _ in range(JOB_WARMUP_STEPS):
        step()
    print("ready", flush=True)
    for line in sys.stdin:
        config, steps = line.split()
        profiler: Any = None
        if config == "torch.profiler":
            profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        durations = []
        for _ in range(int(steps)):
            started = time.perf_counter()
            step()
            durations.append(time.perf_counter() - started)
        if profiler is not None:
            profiler.__exit__(None, None, None)
        print(json.dumps(durations), flush=True)
    return 0


class Agent:
    """Attaches to the job's probe the way dlprof-agent does, for one block."""

    def __init__(self, pid: int, layers: bool) -> None:
        from dlprof_agent.collectors.probe import ProbeClient, find_probe_socket

        path = find_probe_socket(pid)
        assert path is not None, "the job's probe did not start"
        self.client = ProbeClient.connect(pid, path, {
            "interval_seconds": 1.0, "layers": layers, "warmup_steps": 0})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(1.0):
            self.client.snapshot()

    def detach(self) -> None:
        self._stop.set()
        self._thread.join()
        self.client.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block-steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return job(args.batch, args.threads)

    process = subprocess.Popen(
        [sys.executable, __file__, "--job", "--batch", str(args.batch),
         "--threads", str(args.threads)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert process.stdin is not None and process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    medians: dict[str, list[float]] = {config: [] for config in CONFIGS}
    for round_index in range(args.rounds):
        for config in CONFIGS:
            agent = Agent(process.pid, config == "layers") if config in (
                "steps", "layers") else None
            process.stdin.write(f"{config} {args.block_steps + SETTLE_STEPS}\n")
            process.stdin.flush()
            durations: list[float] = json.loads(process.stdout.readline())
            if agent is not None:
                agent.detach()
            medians[config].append(statistics.median(durations[SETTLE_STEPS:]))
        print(f"round {round_index + 1}/{args.rounds}: " + ", ".join(
            f"{config} {medians[config][-1] * 1e3:.2f} ms" for config in CONFIGS),
            file=sys.stderr, flush=True)
    process.stdin.close()
    process.wait(60)

    base = medians["off"]
    spread = (max(base) - min(base)) / statistics.median(base)
    print(f"small CNN (dlprof_agent.workloads.torch_models.small_cnn), batch {args.batch}, "
          f"{args.threads} thread(s), {args.rounds} rounds of {args.block_steps}-step blocks")
    print(f"no-probe step time: median {statistics.median(base) * 1e3:.2f} ms; its blocks "
          f"spread over {spread:.1%} (the machine's noise)")
    print("\nwall-clock step time, per round against that round's no-probe block:")
    print("| configuration | median step | overhead: median | min | max |")
    print("|---|---|---|---|---|")
    for config in CONFIGS[1:]:
        ratios = [on / off - 1 for on, off in zip(medians[config], base, strict=True)]
        print(f"| {config} | {statistics.median(medians[config]) * 1e3:.2f} ms | "
              f"{statistics.median(ratios):+.2%} | {min(ratios):+.2%} | {max(ratios):+.2%} |")
    print_hook_costs(statistics.median(base))
    return 0


def print_hook_costs(cnn_step_seconds: float) -> None:
    """The probe's cost per step and per layer call, measured where it is the
    only thing that varies: a model of ten tiny layers whose compute is next to
    nothing, so a few microseconds stand out of this machine's noise. The
    hooks are installed as the probe installs them, without its socket."""
    import torch
    from torch import nn

    from dlprof_agent.probe.recorder import Recorder
    from dlprof_agent.probe.torch_hooks import TorchHooks

    layers = 10
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.randn(2, 4)

    def median_step(steps: int) -> float:
        durations = []
        for _ in range(steps):
            started = time.perf_counter()
            optimizer.zero_grad()
            model(batch).sum().backward()
            optimizer.step()
            durations.append(time.perf_counter() - started)
        return statistics.median(durations[5:])

    median_step(200)
    costs: dict[str, list[float]] = {"steps": [], "layers": [], "torch.profiler": []}
    for _ in range(20):
        off = median_step(100)
        for config in ("steps", "layers"):
            hooks = TorchHooks(Recorder(warmup_steps=0), layers=config == "layers")
            hooks.install()
            costs[config].append(median_step(100) - off)
            hooks.remove()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            costs["torch.profiler"].append(median_step(100) - off)
    print(f"\ncost per training step, in-process, on {layers} tiny layers (noise-free "
          "estimate); overhead on the CNN above = cost / its no-probe step time:")
    print("| configuration | cost per step | per layer | estimated CNN overhead |")
    print("|---|---|---|---|")
    step_cost = statistics.median(costs["steps"])
    for config, samples in costs.items():
        cost = statistics.median(samples)
        per_layer = (cost - step_cost) / layers if config == "layers" else None
        print(f"| {config} | {cost * 1e6:.1f} us | "
              + (f"{per_layer * 1e6:.1f} us" if per_layer is not None else "-")
              + f" | {cost / cnn_step_seconds:+.2%} |")


if __name__ == "__main__":
    sys.exit(main())
