"""`dlprof-agent workload`: its options, and `list`: the papers' reference models
with their real parameter counts in each installed framework beside the papers'
figures. `run` and `sweep` are workload_run.py's."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

from dlprof_agent.cli import workload_run
from dlprof_agent.cli.arguments import OneLineErrorParser, seconds, whole_number
from dlprof_agent.errors import ExitCode, UsageError
from dlprof_agent.workloads.models import MODELS
from dlprof_agent.workloads.sweep import PARAMETERS as SWEEP_PARAMETERS

FRAMEWORKS = ("pytorch", "tensorflow")


def add_parser(commands: Any,
               parser_class: type[argparse.ArgumentParser] = OneLineErrorParser
               ) -> None:
    workload = commands.add_parser(
        "workload", help="the papers' reference models",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The reference models of the benchmark papers (Shi et al., Kim et al.), "
                    "built the same way in PyTorch and TensorFlow/Keras.",
        epilog="examples:\n"
               "  dlprof-agent workload list\n"
               "  dlprof-agent workload list --json | jq '.[] | {name, pytorch}'\n")
    actions = workload.add_subparsers(dest="workload_command", metavar="ACTION",
                                      parser_class=parser_class)
    listing = actions.add_parser(
        "list", help="each model with its real parameter count beside the paper's",
        description="Build every reference model in each installed framework (PyTorch on "
                    "its meta device, so nothing is allocated) and print its trainable "
                    "parameters beside the figure the paper gives.")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")

    run = actions.add_parser(
        "run", help="train one reference model and print its time per mini-batch",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train MODEL on synthetic, seeded, in-memory data (as the papers did for "
                    "timing) for --warmup plus --iterations mini-batches, and print the time "
                    "per mini-batch (median of the steady iterations), samples per second and "
                    "peak memory. The knobs are the papers' levers.",
        epilog="examples:\n"
               "  dlprof-agent workload run --model alexnet-r\n"
               "  dlprof-agent workload run --framework tensorflow --model resnet-56 "
               "--threads 2\n"
               "  dlprof-agent workload run --model resnet-50 --layout NHWC --precision amp\n"
               "  dlprof-agent workload run --model lstm --scale tiny --json\n")
    _add_run_options(run)
    run.add_argument("--json", action="store_true", help="print JSON instead of text")
    run.add_argument("--attach", action="store_true",
                     help="run under the agent, as `dlprof-agent run --layers` would: serve "
                          "/metrics on --port while it trains, and print the agent's summary "
                          "(steps, layer split, CPU by mode) after the workload's own figures")
    run.add_argument("--port", type=int, default=0,
                     help="with --attach: the port to serve /metrics on (default: a free one)")
    _add_interval_option(run)
    # Under --attach the agent's live line owns the terminal: the child shows no bar.
    run.add_argument("--no-progress", dest="progress", action="store_false",
                     help=argparse.SUPPRESS)
    # Set by --attach for the child it runs: see runner.wait_for_probe.
    run.add_argument("--wait-for-probe", type=seconds(0), default=0.0, help=argparse.SUPPRESS)

    sweep = actions.add_parser(
        "sweep", help="run a grid of settings and write results, a table and plots",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run `workload run` once per point of the grid given by --param (each "
                    "in a fresh process), then write results.csv and results.json, "
                    "table.md laid out like Shi et al.'s Table 7, and plot.png: time per "
                    "mini-batch against the first swept setting, with the CPU user/system "
                    "split and involuntary context switches (the oversubscription signal) "
                    "beside it.",
        epilog="examples:\n"
               "  dlprof-agent workload sweep --model alexnet-r --param threads=1,2,4,8\n"
               "  dlprof-agent workload sweep --framework tensorflow --model resnet-56 \\\n"
               "      --param threads=1,2,4 --param batch_size=32,128 --out resnet56-threads\n")
    _add_run_options(sweep)
    sweep.add_argument("--param", action="append", required=True, metavar="NAME=V1,V2,...",
                       help="a setting and its values: " + ", ".join(SWEEP_PARAMETERS) +
                            "; repeat for a grid")
    sweep.add_argument("--out", metavar="DIR",
                       help="where to write (default: sweep-DATE-TIME in this folder)")
    sweep.add_argument("--attach", action="store_true",
                       help="run every point under the agent and record what it saw over "
                            "the steady steps: CPU user/system per mini-batch and context "
                            "switches, measured from outside the job (the plots then use "
                            "these rather than the run's own rusage)")
    sweep.add_argument("--repeat", type=_positive, default=1, metavar="N",
                       help="run the whole grid N times, point after point in turn (so a "
                            "slow spell of the machine hits every point alike), and report "
                            "each point's median, with the min and max time per mini-batch")
    _add_interval_option(sweep)


def _add_interval_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--interval", type=seconds(0.05), default=0.25, metavar="SECONDS",
                        help="with --attach: seconds between the agent's samples (default "
                             "0.25, so that short runs still get several)")


def _add_run_options(run: argparse.ArgumentParser) -> None:
    run.add_argument("--framework", choices=FRAMEWORKS, default="pytorch",
                     help="the framework that builds and trains the model (default pytorch)")
    run.add_argument("--model", choices=list(MODELS), default="small-cnn", metavar="MODEL",
                     help="the reference model: " + ", ".join(MODELS) + " (default small-cnn; "
                          "`dlprof-agent workload list` describes them)")
    run.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                     help="train on the CPU or the first CUDA GPU (default cpu)")
    run.add_argument("--batch-size", type=_positive, metavar="N",
                     help="samples per mini-batch (default: the papers' CPU batch)")
    run.add_argument("--iterations", type=_positive, default=50, metavar="N",
                     help="timed mini-batches (default 50)")
    run.add_argument("--warmup", type=_non_negative, default=10, metavar="N",
                     help="untimed mini-batches first (default 10)")
    run.add_argument("--threads", type=_positive, metavar="N",
                     help="intra-op threads (default: the framework's)")
    run.add_argument("--inter-op-threads", type=_positive, metavar="N",
                     help="threads that run independent operations side by side "
                          "(default: the framework's)")
    run.add_argument("--layout", choices=("NCHW", "NHWC"),
                     help="image layout: channels-last memory format in PyTorch, "
                          "data_format in TensorFlow (default NCHW / NHWC)")
    run.add_argument("--cudnn-autotune", action="store_true",
                     help="cudnn.benchmark in PyTorch, TF_CUDNN_USE_AUTOTUNE in TensorFlow")
    run.add_argument("--precision", choices=("fp32", "amp"), default="fp32",
                     help="amp: float16 on a GPU, bfloat16 on a CPU")
    run.add_argument("--input-grad", action="store_true",
                     help="also compute the gradient of the input, which training does not "
                          "need (Kim et al. IV-C measured what skipping it saves)")
    run.add_argument("--data-delay", type=seconds(0), default=0.0, metavar="SECONDS",
                     help="wait this long before each mini-batch, like a data loader that "
                          "cannot keep up (default 0): the input-bound case")
    run.add_argument("--scale", choices=("full", "tiny"), default="full",
                     help="tiny: batch 2, for quick checks")
    run.add_argument("--ranks", type=_positive, default=1, metavar="N",
                     help="data-parallel over N processes (PyTorch: torch.distributed, gloo "
                          "on CPU, NCCL on GPU; TensorFlow: tf.distribute "
                          "MultiWorkerMirroredStrategy, ring on CPU, NCCL on GPU), reporting "
                          "each rank's compute and gradient-exchange time")
    run.add_argument("--data", metavar="PATH",
                     help="train on real files instead of synthetic data: a folder with "
                          "MNIST's train-images-idx3-ubyte and train-labels-idx1-ubyte "
                          "(optionally .gz) for fcn-r, or CIFAR-10's binary batches "
                          "(data_batch_*.bin) for alexnet-r, resnet-56 and small-cnn")


_positive = whole_number(1)
_non_negative = whole_number(0)


def _counters() -> dict[str, Callable[[str], int]]:
    """A parameter counter per installed framework."""
    counters: dict[str, Callable[[str], int]] = {}
    if importlib.util.find_spec("torch") is not None:
        import torch

        from dlprof_agent.workloads import torch_models

        def count_torch(name: str) -> int:
            with torch.device("meta"):  # shapes only: FCN-S's 122M weights cost nothing
                return torch_models.trainable_parameters(torch_models.build(name))
        counters["pytorch"] = count_torch
    if importlib.util.find_spec("tensorflow") is not None:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # no start-up chatter
        from dlprof_agent.workloads import keras_models

        def count_keras(name: str) -> int:
            return keras_models.trainable_parameters(keras_models.build(name))
        counters["tensorflow"] = count_keras
    return counters


def model_rows(progress: TextIO | None = None) -> list[dict[str, Any]]:
    counters = _counters()
    rows = []
    for index, spec in enumerate(MODELS.values(), 1):
        if progress is not None:
            progress.write(f"\rbuilding {spec.name} ({index}/{len(MODELS)})...\x1b[K")
            progress.flush()
        row: dict[str, Any] = {"name": spec.name, "kind": spec.kind,
                               "input_shape": list(spec.input_shape),
                               "classes": spec.classes, "cpu_batch": spec.cpu_batch,
                               "paper_params": spec.paper_params,
                               "description": spec.description}
        for framework in FRAMEWORKS:
            row[framework] = counters[framework](spec.name) if framework in counters else None
        rows.append(row)
    if progress is not None:
        progress.write("\r\x1b[K")
        progress.flush()
    return rows


def _millions(count: int | None) -> str:
    if count is None:
        return "-"
    return f"{count / 1e6:.2f}M" if count >= 1e6 else f"{count / 1e3:.1f}K"


def render_table(rows: list[dict[str, Any]]) -> str:
    header = ("model", "input", "paper", "pytorch", "tensorflow", "same")
    lines = [header]
    for row in rows:
        counts = {row[f] for f in FRAMEWORKS if row[f] is not None}
        same = "yes" if len(counts) == 1 and all(row[f] is not None for f in FRAMEWORKS) else (
            "NO" if len(counts) > 1 else "-")
        lines.append((row["name"], "x".join(map(str, row["input_shape"])), row["paper_params"],
                      _millions(row["pytorch"]), _millions(row["tensorflow"]), same))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths,
                                                                          strict=True)).rstrip()
                     for line in lines)


def workload_command(args: argparse.Namespace, out: TextIO) -> int:
    if args.workload_command == "sweep":
        return workload_run.sweep_command(args, out)
    if args.workload_command == "run":
        return workload_run.run_command(args, out)
    if args.workload_command != "list":
        raise UsageError("no workload action given", "use e.g. `dlprof-agent workload list`")
    rows = model_rows(sys.stderr if sys.stderr.isatty() else None)
    if args.json:
        out.write(json.dumps(rows, indent=2) + "\n")
    else:
        out.write(render_table(rows) + "\n")
        missing = [f for f in FRAMEWORKS if all(row[f] is None for row in rows)]
        if missing:
            out.write(f"({', '.join(missing)} not installed: no count)\n")
    return ExitCode.FINISHED



def run(args: argparse.Namespace) -> int:
    return workload_command(args, sys.stdout)
