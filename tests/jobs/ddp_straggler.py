"""One rank of a two-rank DistributedDataParallel job (gloo on 127.0.0.1, one
intra-op thread) with the probe's recorder and PyTorch hooks in this process, as
tests/test_probe_torch_phases.py sets them up. Rank ``--slow-rank`` sleeps in
its input before every step; each step ends with an all-reduce of the loss, as
a loop that logs the mean loss does. Writes the recorder's snapshots (after the
warm-up and at the end), the probe's process_group setting and the CPU time of
the measured steps to ``--out`` as JSON.

With ``--compare-rounds N`` it measures instead what timing the exchange costs
a step: blocks of ``--steps`` steps with the exchange timed and not (the probe
with layer timing in both), taking turns, each round starting with the other,
and writes each block's median step time (the job's own clock) and CPU time
per step (the whole process: gloo's threads too).

Run: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python -m
tests.jobs.ddp_straggler --out FILE."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dlprof_agent.probe.distributed import torch_process_group
from dlprof_agent.probe.recorder import LayerSampling, Recorder
from dlprof_agent.probe.torch_hooks import TorchHooks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--input-seconds", type=float, default=0.02)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--compare-rounds", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(),
                                                  nn.Linear(64, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    inputs, labels = torch.randn(16, 32), torch.randint(0, 10, (16,))
    # As the agent sets it up: duty-cycled layer timing under the default budget.
    recorder = Recorder(warmup_steps=args.warmup, layer_sampling=LayerSampling())
    hooks = TorchHooks(recorder, layers=True)
    hooks.install()

    def step() -> None:
        if rank == args.slow_rank:
            time.sleep(args.input_seconds)  # the input this rank waits for
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        optimizer.step()
        dist.all_reduce(loss.detach())

    try:
        # Discovery takes two steps, then the warm-up, then one to open a steady step.
        for _ in range(args.warmup + 3):
            step()
        if args.compare_rounds:
            result: dict[str, object] = {"rank": rank, "blocks": compare(
                hooks, step, args.compare_rounds, args.steps)}
        else:
            before, cpu_before = recorder.snapshot(), time.process_time()
            for _ in range(args.steps):
                step()
            after, cpu_after = recorder.snapshot(), time.process_time()
            result = {"rank": rank, "before": before, "after": after,
                      "cpu_seconds": cpu_after - cpu_before,
                      "process_group": torch_process_group()}
    finally:
        hooks.remove()
    dist.barrier()
    dist.destroy_process_group()
    with open(args.out, "w") as out:
        json.dump(result, out)
    return 0


def compare(hooks: TorchHooks, step: Callable[[], None], rounds: int,
            steps: int) -> list[tuple[str, float, float]]:
    """Each block's configuration, median step seconds and the process's CPU
    seconds per step, interleaved."""
    blocks = []
    for round_index in range(rounds):
        for timed in (True, False) if round_index % 2 == 0 else (False, True):
            # The two parts of the exchange timing, in or out (the probe's own switches).
            hooks._collectives.active = timed
            hooks._ddp_wait.ddp = timed
            seconds = []
            cpu_started = time.process_time()
            for _ in range(steps):
                started = time.perf_counter()
                step()
                seconds.append(time.perf_counter() - started)
            blocks.append(("exchange" if timed else "no exchange", statistics.median(seconds),
                           (time.process_time() - cpu_started) / steps))
    return blocks


if __name__ == "__main__":
    sys.exit(main())
