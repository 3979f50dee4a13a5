"""Trains the small CNN on synthetic data for a while: a real PyTorch job for
`dlprof-agent demo` to attach to. Prints one line once it is training."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from dlprof_agent.workloads.torch_models import small_cnn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = small_cnn().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    images = torch.randn(args.batch, 3, 32, 32, device=device)
    labels = torch.randint(0, 10, (args.batch,), device=device)
    deadline = time.monotonic() + args.seconds
    announced = False
    while time.monotonic() < deadline:
        optimizer.zero_grad()
        loss_fn(model(images), labels).backward()
        optimizer.step()
        if not announced:
            print("training", flush=True)
            announced = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
