"""The probe's cost to a training job: step time with the probe attached (step
timing only, and with --layers) against no probe, and torch.profiler with CPU
activities for comparison, on a small CNN on the CPU.

Each configuration runs in a fresh job process; the configurations alternate
within each repetition, so drift of the machine hits them all alike. The ratio
is taken per repetition (configuration over that repetition's no-probe run)
and reported as median, min and max.

    python benchmarks/probe_overhead.py --repeats 7 --steps 400
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
JOB_WARMUP_STEPS = 30


def job(config: str, steps: int, batch: int, threads: int) -> int:
    """One training job: warm up, say ready, wait for go, time ``steps`` steps."""
    import torch

    from dlprof_agent.workloads.torch_models import small_cnn

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    if config in ("steps", "layers"):
        import dlprof_agent.probe

        dlprof_agent.probe.enable()
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
    sys.stdin.readline()
    profiler: Any = None
    if config == "torch.profiler":
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        profiler.__enter__()
    durations = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        durations.append(time.perf_counter() - started)
    if profiler is not None:
        profiler.__exit__(None, None, None)
    print(json.dumps(durations), flush=True)
    return 0


def run_one(config: str, args: argparse.Namespace) -> float:
    """Median step time of one job run under ``config``."""
    from dlprof_agent.collectors.probe import ProbeClient, find_probe_socket

    process = subprocess.Popen(
        [sys.executable, __file__, "--job", config, "--steps", str(args.steps),
         "--batch", str(args.batch), "--threads", str(args.threads)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert process.stdin is not None and process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    client = None
    stop = threading.Event()
    if config in ("steps", "layers"):
        path = find_probe_socket(process.pid)
        assert path is not None, "the job's probe did not start"
        # Warm-up is the job's own here: every timed step is a measured one.
        client = ProbeClient.connect(process.pid, path, {
            "interval_seconds": 1.0, "layers": config == "layers", "warmup_steps": 0})

        def poll() -> None:  # what an attached agent does: a snapshot every interval
            while not stop.wait(1.0):
                client.snapshot()

        threading.Thread(target=poll, daemon=True).start()
        time.sleep(0.2)  # the hooks install on the probe's thread
    process.stdin.write("go\n")
    process.stdin.flush()
    durations: list[float] = json.loads(process.stdout.readline())
    stop.set()
    if client is not None:
        client.stop()
    process.wait(60)
    return statistics.median(durations)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--job", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        return job(args.job, args.steps, args.batch, args.threads)

    medians: dict[str, list[float]] = {config: [] for config in CONFIGS}
    for repeat in range(args.repeats):
        for config in CONFIGS:
            medians[config].append(run_one(config, args))
        print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(
            f"{config} {medians[config][-1] * 1e3:.2f} ms" for config in CONFIGS),
            file=sys.stderr, flush=True)
    base = medians["off"]
    spread = (max(base) - min(base)) / statistics.median(base)
    print(f"small CNN, batch {args.batch}, {args.threads} thread(s), {args.steps} timed "
          f"steps per run, {args.repeats} interleaved repeats")
    print(f"no-probe step time: median {statistics.median(base) * 1e3:.2f} ms, "
          f"spread across repeats {spread:.1%} (the machine's noise)")
    print("| configuration | median step | overhead: median | min | max |")
    print("|---|---|---|---|---|")
    for config in CONFIGS[1:]:
        ratios = [on / off - 1 for on, off in zip(medians[config], base, strict=True)]
        print(f"| {config} | {statistics.median(medians[config]) * 1e3:.2f} ms | "
              f"{statistics.median(ratios):+.2%} | {min(ratios):+.2%} | {max(ratios):+.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
