"""One rank of a DistributedDataParallel job started by torchrun (gloo, one
thread each): a small CNN on tensors held in memory, each step's end logged
(step_log.py) to STEP_LOG.RANK. Rank --slow-rank, if given, sleeps
--input-sleep-ms before each step, where a job waits for its input, so the
other ranks wait for it in the gradient all-reduce. With --pin, rank R runs on
the R-th CPU it may use only (the test then starves one rank's CPU)."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.jobs.step_log import StepLog, arguments, enable_probe


def main() -> int:
    parser = arguments(__doc__ or "")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--input-sleep-ms", type=float, default=20.0)
    parser.add_argument("--pin", action="store_true")
    parser.add_argument("--cpus", default="",
                        help="with --pin, the CPUs to pin the ranks to (default: this one's)")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    if args.pin:
        cpus = ([int(cpu) for cpu in args.cpus.split(",")] if args.cpus
                else sorted(os.sched_getaffinity(0)))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    args.step_log = f"{args.step_log}.{rank}"
    enable_probe()
    torch.manual_seed(rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = DistributedDataParallel(nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(32, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    images = torch.randn(args.batch, 3, 32, 32)
    labels = torch.randint(0, 10, (args.batch,))
    log = StepLog(args, "torchrun_ddp")
    stop = torch.zeros(1)
    while True:
        if rank == args.slow_rank:
            time.sleep(args.input_sleep_ms / 1000)  # a slow input pipeline
        optimizer.zero_grad()
        loss_fn(model(images), labels).backward()
        optimizer.step()
        stop.fill_(1.0 if log.step_ended() else 0.0)
        dist.all_reduce(stop)  # both ranks stop after the same step
        if stop.item() > 0:
            break
    log.done()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
