"""Data-parallel training of a reference model over N processes on this
machine, with torch.distributed (gloo on CPUs, NCCL on GPUs), timed the way the
papers asked their scaling question: per rank, the compute of each step
(forward, backward, update) apart from the gradient exchange (an all-reduce of
all gradients, flattened into one buffer).

The launcher is the process that calls `run_distributed`; the ranks are its
children, so an agent attached to the launcher's pid reads every rank, each
under its own pid."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

from dlprof_agent.workloads.runner import RunConfig


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_distributed(config: RunConfig, ranks: int) -> dict[str, Any]:
    """Start ``ranks`` processes, wait for them, and combine what each measured."""
    port = _free_port()
    environment = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "WORLD_SIZE": str(ranks)}
    workers = [subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent.workloads.distributed", json.dumps(asdict(config))],
        env={**environment, "RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for rank in range(ranks)]
    reports = []
    failures = []
    for rank, worker in enumerate(workers):
        stdout, stderr = worker.communicate()
        if worker.returncode != 0:
            failures.append(f"rank {rank}: " + (stderr.strip().splitlines() or ["failed"])[-1])
        else:
            reports.append(json.loads(stdout))
    if failures:
        raise RuntimeError("; ".join(failures))
    return combine_reports(config, reports)


def combine_reports(config: RunConfig, reports: list[dict[str, Any]],
                    extra_per_rank: tuple[str, ...] = ()) -> dict[str, Any]:
    """The run's figures from the ranks' reports: a step takes as long as its
    slowest rank; compute and exchange are each rank's medians. ``extra_per_rank``:
    report keys carried over as they are."""
    step = [max(r["step_seconds"][i] for r in reports)
            for i in range(len(reports[0]["step_seconds"]))]
    seconds_per_batch = statistics.median(step)
    batch, ranks = reports[0]["batch_size"], len(reports)
    return {
        **asdict(config), "ranks": ranks, "batch_size": batch,
        "global_batch_size": batch * ranks, "parameters": reports[0]["parameters"],
        "gradient_bytes": reports[0]["gradient_bytes"],
        "seconds_per_batch": seconds_per_batch,
        "samples_per_second": batch * ranks / seconds_per_batch,
        "per_rank": [{"rank": r["rank"], "pid": r["pid"],
                      "compute_seconds_per_batch": statistics.median(r["compute_seconds"]),
                      "exchange_seconds_per_batch": statistics.median(r["exchange_seconds"]),
                      **{key: r[key] for key in extra_per_rank}}
                     for r in reports],
    }


def _rank_main(config: RunConfig) -> int:
    import torch
    import torch.distributed as dist

    from dlprof_agent.workloads import torch_models

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = config.device == "cuda"
    if config.intra_op_threads:
        torch.set_num_threads(config.intra_op_threads)
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    batch = config.resolved_batch()
    model = torch_models.build(config.model).to(device)
    for parameter in model.parameters():  # every rank starts from rank 0's weights
        dist.broadcast(parameter.data, 0)
    generator = torch.Generator().manual_seed(rank)
    inputs, targets = torch_models.example_batch(config.model, batch, generator=generator)
    inputs, targets = inputs.to(device), targets.to(device)
    loss_fn = torch_models.loss_fn(config.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trainable = [p for p in model.parameters() if p.requires_grad]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    compute, exchange, steps = [], [], []
    for index in range(config.warmup + config.iterations):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=False)
        torch.autograd.backward(loss_fn(model(inputs), targets))
        sync()
        backward_done = time.perf_counter()
        flat = torch.cat([p.grad.reshape(-1) for p in trainable if p.grad is not None])
        dist.all_reduce(flat)
        flat /= world
        offset = 0
        for parameter in trainable:
            if parameter.grad is not None:
                size = parameter.grad.numel()
                parameter.grad.copy_(flat[offset:offset + size].view_as(parameter.grad))
                offset += size
        sync()
        exchanged = time.perf_counter()
        optimizer.step()
        sync()
        done = time.perf_counter()
        if index >= config.warmup:
            compute.append((backward_done - started) + (done - exchanged))
            exchange.append(exchanged - backward_done)
            steps.append(done - started)
    report = {"rank": rank, "pid": os.getpid(), "batch_size": batch,
              "parameters": torch_models.trainable_parameters(model),
              "gradient_bytes": sum(p.numel() * p.element_size() for p in trainable),
              "compute_seconds": compute, "exchange_seconds": exchange, "step_seconds": steps}
    dist.destroy_process_group()
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(RunConfig(**json.loads(sys.argv[1]))))
