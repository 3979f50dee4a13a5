"""A train step compiled whole (the pattern of torch.compile's tutorials): one
``torch.compile``d function runs the forward, the loss and ``loss.backward()``, and
the optimizer steps after it; a small CNN on random images held in memory, each
step's end logged (step_log.py). The model's own hooks never fire inside it."""

from __future__ import annotations

import sys
from typing import Any

import torch

from dlprof_agent.workloads.torch_models import small_cnn
from tests.jobs.step_log import StepLog, arguments, enable_probe


def main() -> int:
    args = arguments(__doc__ or "").parse_args()
    enable_probe()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = small_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(args.batch, 3, 32, 32)
    labels = torch.randint(0, 10, (args.batch,))

    def forward_backward(images: Any, labels: Any) -> Any:
        loss: Any = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        return loss

    # AOTAutograd compiles forward and backward as graphs, without a C++ compiler.
    compiled = torch.compile(forward_backward, backend="aot_eager")
    log = StepLog(args, "compiled_step")
    while True:
        optimizer.zero_grad()
        compiled(images, labels)
        optimizer.step()
        if log.step_ended():
            break
    log.done()
    return 0


if __name__ == "__main__":
    sys.exit(main())
