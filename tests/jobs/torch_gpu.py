"""A training job on the GPU for the kernel tracer's GPU tests (``-m gpu``).

Each step is forward, backward and the optimizer's step, then a synchronize, so
a step's kernels finish inside it; its end time goes to --log. The test steers
it with files in --control:

- ``pause-<step>`` in --pause-at: after that step the job waits for
  ``resume-<step>`` (so counters can be read between known steps);
- ``profile``: the job runs torch.profiler (CUDA activities) over the next
  --profile-steps steps and writes what it measured to ``profile-<n>.json``:
  per-kernel totals from the profiler's own Chrome trace (cat ``kernel``), so
  they compare with dlprof-agent's.

``--copy-bytes B`` replaces the model with B bytes copied host to device (from
pinned memory) and back each step: a transfer of known size.

``--deterministic`` makes the steps repeat bit for bit and logs the SHA-256 of the
model's weights at each pause and at the end, so that a run the agent reached can be
compared with an untouched one.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]


def profile_totals(prof: Any, steps: int) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        path = handle.name
    try:
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text()).get("traceEvents", [])
    finally:
        os.unlink(path)
    totals: dict[str, float] = {}
    count = 0
    kernel_us = memcpy_us = memset_us = 0.0
    for event in events:
        category = str(event.get("cat", "")).lower()
        duration = float(event.get("dur", 0))
        if category == "kernel":
            kernel_us += duration
            count += 1
            totals[event["name"]] = totals.get(event["name"], 0.0) + duration
        elif category == "gpu_memcpy":
            memcpy_us += duration
        elif category == "gpu_memset":
            memset_us += duration
    return {"steps": steps, "kernel_us": kernel_us, "kernels": count, "memcpy_us": memcpy_us,
            "memset_us": memset_us, "by_name_us": totals}


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the model's parameters and buffers, byte for byte."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        data = tensor.detach().cpu().contiguous()
        digest.update(name.encode())
        # The bytes as they are, without numpy (not every image has it)
        digest.update(ctypes.string_at(data.data_ptr(), data.numel() * data.element_size()))
    return digest.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log", required=True)
    parser.add_argument("--control", required=True, help="folder of the test's control files")
    parser.add_argument("--model", default="resnet-50")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--pause-at", default="", help="comma-separated steps to pause after")
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--copy-bytes", type=int, default=0)
    parser.add_argument("--copy-every", type=int, default=0,
                        help="also copy a pinned 1 MiB to the GPU and back every N steps")
    parser.add_argument("--enable-probe", action="store_true")
    parser.add_argument("--deterministic", action="store_true",
                        help="repeatable steps; the weights' SHA-256 at pauses and the end")
    parser.add_argument("--device", default="cuda",
                        help="cpu: the same job without a GPU, to check a harness on")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from dlprof_agent.workloads import torch_models

    control = Path(args.control)
    pauses = {int(step) for step in args.pause_at.split(",") if step}
    if args.enable_probe:
        import dlprof_agent.probe

        dlprof_agent.probe.enable()
    if args.deterministic:
        # cuBLAS reads it at its first handle. warn_only: an op with no deterministic
        # CUDA kernel warns on stderr instead of ending the job (ResNet-50 has none:
        # its pooling to 1x1 is a mean), and the test shows those warnings.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        # No NaN fill kernel after each allocation: the job's kernels stay as they were
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined,unused-ignore]
        torch.backends.cudnn.deterministic = True
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = False  # the same kernels every step
    device = torch.device(args.device)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    step_once: Any
    weighed: torch.nn.Module | None = None  # whose weights --deterministic logs
    if args.copy_bytes:
        host = torch.empty(args.copy_bytes, dtype=torch.uint8).pin_memory()
        back = torch.empty(args.copy_bytes, dtype=torch.uint8).pin_memory()
        on_device = torch.empty(args.copy_bytes, dtype=torch.uint8, device=device)

        def step_once() -> None:
            on_device.copy_(host)
            back.copy_(on_device)
    else:
        model = weighed = torch_models.build(args.model).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        loss_fn = torch_models.loss_fn(args.model)
        inputs, targets = torch_models.example_batch(args.model, args.batch)
        inputs, targets = inputs.to(device), targets.to(device)

        def step_once() -> None:
            optimizer.zero_grad()
            torch.autograd.backward(loss_fn(model(inputs), targets))
            optimizer.step()

    pinned = torch.empty(1 << 20, dtype=torch.uint8).pin_memory() if args.copy_every else None
    on_gpu = torch.empty(1 << 20, dtype=torch.uint8, device=device) if args.copy_every else None

    def copy_once() -> None:
        assert pinned is not None and on_gpu is not None
        on_gpu.copy_(pinned)
        pinned.copy_(on_gpu)

    def log_weights(log: Any, step: int) -> None:
        if args.deterministic and weighed is not None:
            log.write(json.dumps({"step": step, "weights": weights_digest(weighed)}) + "\n")

    profiles = 0
    with open(args.log, "w") as log:
        log.write(json.dumps({"pid": os.getpid()}) + "\n")
        step = 0
        while step < args.steps:
            if (control / "profile").exists():
                (control / "profile").unlink()
                activities = [torch.profiler.ProfilerActivity.CUDA
                              if device.type == "cuda" else torch.profiler.ProfilerActivity.CPU]
                with torch.profiler.profile(activities=activities) as prof:
                    for _ in range(args.profile_steps):
                        step_once()
                        synchronize()
                        step += 1
                        log.write(json.dumps({"step": step, "end": time.perf_counter(),
                                              "profiled": True}) + "\n")
                        log.flush()
                out = control / f"profile-{profiles}.json"
                out.write_text(json.dumps(profile_totals(prof, args.profile_steps)))
                profiles += 1
                continue
            step_once()
            if args.copy_every and step % args.copy_every == 0:
                copy_once()
            synchronize()
            step += 1
            log.write(json.dumps({"step": step, "end": time.perf_counter()}) + "\n")
            log.flush()
            if step in pauses:
                log_weights(log, step)
                log.write(json.dumps({"paused": step}) + "\n")
                log.flush()
                while not (control / f"resume-{step}").exists():
                    time.sleep(0.05)
        log_weights(log, step)
        log.write(json.dumps({"done": True}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
