"""`demo`: start a small training job (or a busy process without torch), attach
to it as `attach` does, and show some of the series a Prometheus scrape gets."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from typing import Any, TextIO

from dlprof_agent.agent.endpoint import DEFAULT_LISTEN, DEFAULT_PORT
from dlprof_agent.agent.serve import ServeOptions, serve
from dlprof_agent.cli.arguments import paragraph
from dlprof_agent.cli.options import add_sampling_options, add_serving_options, serve_options
from dlprof_agent.errors import EXIT_CODES_HELP, PortUnavailable
from dlprof_agent.probe.messages import DEFAULT_WARMUP_STEPS
from dlprof_agent.probe_link.connect import ProbeOptions

DEMO_SERIES = ("dlprof_target_up", "dlprof_process_cpu_seconds_total",
               "dlprof_process_threads", "dlprof_thread_group_threads",
               "dlprof_process_resident_memory_peak_bytes", "dlprof_gpu_available",
               "dlprof_probe_up", "dlprof_steps_total", "dlprof_samples_total",
               "dlprof_step_duration_seconds_sum", "dlprof_step_duration_seconds_count",
               "dlprof_step_phase_seconds_total", "dlprof_framework_info")

log = logging.getLogger("dlprof_agent")


def _cuda_available() -> bool:
    """Asked in a child: importing torch here would cost the agent a second of start-up
    and hundreds of MiB for the rest of the demo."""
    check = subprocess.run([sys.executable, "-c",
                            "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"],
                           capture_output=True, timeout=60, check=False)
    return check.returncode == 0


def _start_demo_workload(args: argparse.Namespace, seconds: float, out: TextIO
                         ) -> tuple[subprocess.Popen[bytes], bool]:
    """A PyTorch training job when torch is installed, else a busy process."""
    if importlib.util.find_spec("torch") is not None:
        # On a GPU when the machine has one: NVML and the probe then both have work to see.
        device = "cuda" if _cuda_available() else "cpu"
        print(f"demo: starting a PyTorch job (a small CNN on synthetic data, on {device})...",
              file=out, flush=True)
        job = subprocess.Popen(
            [sys.executable, "-m", "dlprof_agent.workloads.torch_train", "--seconds",
             str(seconds), "--threads", str(min(args.threads, os.cpu_count() or 1)),
             "--device", device, "--batch", "256" if device == "cuda" else "32"],
            stdout=subprocess.PIPE)
        assert job.stdout is not None
        job.stdout.readline()  # "training", or nothing if it failed
        if job.poll() is None:
            print(f"demo: pid {job.pid} is training; attaching and injecting the probe, with "
                  "layer timing", file=out)
            return job, True
        log.info("the PyTorch demo job did not start; using a busy process instead")
    workload = subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent.workloads.busy", "--threads", str(args.threads),
         "--children", "1", "--seconds", str(seconds)], stdout=subprocess.DEVNULL)
    time.sleep(0.5)  # let the workload start its threads and child
    print(f"demo: started a busy process, pid {workload.pid}, with {args.threads} "
          "worker threads and one child", file=out)
    return workload, False


def demo_command(args: argparse.Namespace, options: ServeOptions, out: TextIO) -> int:
    workload, trains = _start_demo_workload(args, (options.duration or 10) + 30, out)
    if trains:
        options = replace(options, probe=ProbeOptions(layers=True,
                                                      warmup_steps=DEFAULT_WARMUP_STEPS))
    exposition: list[str] = []

    def fetch_metrics(port: int) -> None:
        # Read from the live endpoint, as Prometheus would see it.
        host = f"[{options.listen}]" if ":" in options.listen else options.listen
        url = f"http://{host}:{port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                exposition.append(response.read().decode())
        except OSError as error:
            log.info("could not read the demo's own endpoint: %s", error)

    try:
        print(f"demo: watching for {options.duration:g} s", file=out)
        try:
            code = serve(workload.pid, options, out=out, before_stop=fetch_metrics)
        except PortUnavailable:
            log.info("port %d is in use; the demo takes a free one instead", options.port)
            options = replace(options, port=0)
            code = serve(workload.pid, options, out=out, before_stop=fetch_metrics)
    finally:
        workload.terminate()
        workload.wait(5)
    if exposition:
        print("\nwhat Prometheus scrapes (a few of the series):", file=out)
        for line in _demo_lines(exposition[0]):
            print("  " + line, file=out)
    return code


def _demo_lines(exposition: str) -> list[str]:
    return [line for line in exposition.splitlines()
            if line.startswith(DEMO_SERIES)][:32]


def add_parser(commands: Any) -> None:
    demo = commands.add_parser(
        "demo", help="start a demo training job, attach to it, and show what the agent sees",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=paragraph("Start a small PyTorch training job (a CNN on synthetic data; "
                    "without torch, a synthetic busy process with named threads and a "
                    "child), attach to it as `attach` would, injecting the probe with layer "
                    "timing, and after --duration print the summary and some of the series "
                    "a Prometheus scrape gets."),
        epilog="examples:\n"
               "  dlprof-agent demo\n"
               "  dlprof-agent demo --duration 60 --threads 8   (then scrape "
               f"http://{DEFAULT_LISTEN}:{DEFAULT_PORT}/metrics)\n\n" + EXIT_CODES_HELP)
    demo.add_argument("--threads", type=int, default=3,
                      help="the job's threads: PyTorch intra-op threads (at most the CPU "
                           "count), or busy worker threads (default 3)")
    add_serving_options(demo, duration_default=10.0)
    add_sampling_options(demo)


def run(args: argparse.Namespace) -> int:
    # The probe is chosen once the demo knows what it started.
    return demo_command(args, serve_options(args, None), sys.stdout)
