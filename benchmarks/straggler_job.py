"""One rank of the straggler benchmark's job (benchmarks/stragglers.py): a
DistributedDataParallel small CNN on synthetic data, started by torchrun with
gloo and one thread, pinned to the CPU of its rank, stepping until the stop file
appears. The rank runs with whatever probe its launch gives it (DLPROF_PROBE=1)
and knows nothing of the agent.

Its faults are the harness's to set: before each step it reads
``FAULT_DIR/rank-R`` when that file changed. ``input SECONDS`` sleeps that long
where a job waits for its data; ``compute FACTOR`` trains that many times the
batch, so its forward, backward and optimizer take longer; an empty file is
healthy. The other causes come from outside (busy threads, the cgroup, the link).
With ``--cgroup``, the rank joins that memory cgroup before it imports torch, so
what it allocates is charged there; it samples its batches from an in-memory
dataset of ``--dataset`` images, as a job that holds its data in memory does.

    torchrun ... benchmarks/straggler_job.py --fault-dir DIR --stop FILE --batch 32
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


class Faults:
    """The fault file of this rank, read again only when its mtime changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.stamp = -1
        self.input_seconds = 0.0
        self.compute_factor = 1

    def poll(self) -> None:
        try:
            stamp = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            stamp = 0
        if stamp == self.stamp:
            return
        self.stamp = stamp
        self.input_seconds, self.compute_factor = 0.0, 1
        words = Path(self.path).read_text().split() if stamp else []
        if len(words) == 2 and words[0] == "input":
            self.input_seconds = float(words[1])
        elif len(words) == 2 and words[0] == "compute":
            self.compute_factor = int(words[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fault-dir", required=True)
    parser.add_argument("--stop", required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--cpus", required=True, help="the CPUs of the ranks, comma-separated")
    parser.add_argument("--cgroup", default="", help="a memory cgroup folder to join")
    parser.add_argument("--dataset", type=int, default=16384, help="images held in memory")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    if args.cgroup:
        with open(os.path.join(args.cgroup, "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    cpus = [int(cpu) for cpu in args.cpus.split(",")]
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    torch.manual_seed(rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # workloads.torch_models's small CNN, written out: the probe copied onto the path
    # holds a dlprof_agent of its own, without the workloads.
    model = DistributedDataParallel(nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    faults = Faults(os.path.join(args.fault_dir, f"rank-{rank}"))
    dataset = torch.randn(args.dataset, 3, 32, 32)
    targets = torch.randint(0, 10, (args.dataset,))
    stop = torch.zeros(1)
    while True:
        faults.poll()
        if faults.input_seconds:
            time.sleep(faults.input_seconds)  # the data path
        picked = torch.randint(0, args.dataset, (args.batch * faults.compute_factor,))
        images, labels = dataset[picked], targets[picked]
        optimizer.zero_grad()
        loss_fn(model(images), labels).backward()
        optimizer.step()
        stop.fill_(1.0 if os.path.exists(args.stop) else 0.0)
        dist.all_reduce(stop)  # every rank stops after the same step
        if stop.item() > 0:
            break
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
