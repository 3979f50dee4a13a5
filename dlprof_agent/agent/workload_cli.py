"""`dlprof-agent workload`: the papers' reference models, listed with their real
parameter counts in each installed framework beside the papers' figures."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any, TextIO

from dlprof_agent.agent.arguments import seconds, whole_number
from dlprof_agent.errors import UsageError
from dlprof_agent.workloads.models import MODELS
from dlprof_agent.workloads.sweep import PARAMETERS as SWEEP_PARAMETERS

FRAMEWORKS = ("pytorch", "tensorflow")
# How long an attached run holds its first step for the agent's probe.
PROBE_WAIT_SECONDS = 30.0


def add_parser(commands: Any, parser_class: type[argparse.ArgumentParser]) -> None:
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


def _check_device(framework: str, device: str) -> None:
    if device != "cuda":
        return
    if framework == "pytorch":
        import torch

        available = torch.cuda.is_available()
    else:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import tensorflow as tf

        available = bool(tf.config.list_physical_devices("GPU"))
    if not available:
        raise UsageError(f"no CUDA GPU is available to {framework} here", "use --device cpu")


def _progress(total_label: str) -> Callable[[int, int], None] | None:
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        filled = 30 * done // total
        sys.stderr.write(f"\r{total_label} [{'#' * filled}{'.' * (30 - filled)}] "
                         f"{done}/{total}\x1b[K")
        if done == total:
            sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()
    return show


def _config(args: argparse.Namespace) -> Any:
    from dlprof_agent.workloads.runner import RunConfig

    return RunConfig(
        framework=args.framework, model=args.model, device=args.device,
        batch_size=args.batch_size, iterations=args.iterations, warmup=args.warmup,
        intra_op_threads=args.threads, inter_op_threads=args.inter_op_threads,
        layout=args.layout, cudnn_autotune=args.cudnn_autotune, precision=args.precision,
        input_grad=args.input_grad, scale=args.scale, data=args.data,
        data_delay_seconds=args.data_delay,
        wait_for_probe_seconds=getattr(args, "wait_for_probe", 0.0))


def _distributed_command(args: argparse.Namespace, out: TextIO) -> int:
    # Neither launcher imports its framework: the ranks do.
    from dlprof_agent.workloads import distributed, tf_distributed

    run_distributed: Callable[..., dict[str, Any]] = (
        tf_distributed.run_distributed if args.framework == "tensorflow"
        else distributed.run_distributed)
    if args.data or args.precision != "fp32" or args.layout:
        raise UsageError("--ranks runs synthetic fp32 data in the default layout so far",
                         "leave out --data, --precision and --layout")
    try:
        result = run_distributed(_config(args), args.ranks)
    except RuntimeError as error:
        raise UsageError(f"the data-parallel run failed: {str(error)[:300]}",
                         "check the ranks' settings") from None
    if args.json:
        out.write(json.dumps(result, indent=2) + "\n")
        return 0
    out.write(f"{args.framework} {args.model} data-parallel over {args.ranks} processes on "
              f"{args.device}, batch {result['batch_size']} per rank, gradients "
              f"{result['gradient_bytes'] / 2**20:.1f} MiB per step\n"
              f"  time per mini-batch  {result['seconds_per_batch'] * 1000:.2f} ms "
              f"(slowest rank, median)\n"
              f"  samples per second   {result['samples_per_second']:.1f} (all ranks)\n")
    for rank in result["per_rank"]:
        out.write(f"  rank {rank['rank']} (pid {rank['pid']})  compute "
                  f"{rank['compute_seconds_per_batch'] * 1000:.2f} ms, gradient exchange "
                  f"{rank['exchange_seconds_per_batch'] * 1000:.2f} ms\n")
    return 0


def _attached(args: argparse.Namespace) -> int:
    """The same `workload run`, minus --attach, as a child the agent attaches to."""
    from dlprof_agent.agent.cli import DEFAULT_LISTEN, ServeOptions, run_command
    from dlprof_agent.agent.reach.connect import ProbeOptions

    child = [sys.executable, "-m", "dlprof_agent", "workload", "run",
             *_base_run_args(args), "--ranks", str(args.ranks), "--no-progress"]
    if args.ranks == 1:
        child += ["--wait-for-probe", str(PROBE_WAIT_SECONDS)]
    child += ["--json"] if args.json else []
    # The probe's warm-up is the run's: its steady steps are the run's timed ones.
    options = ServeOptions(listen=DEFAULT_LISTEN, port=args.port, interval=args.interval,
                           duration=None, grace=0.0, quiet=args.json, children=True, gpu=True,
                           probe=ProbeOptions(inject=False, layers=True,
                                              warmup_steps=args.warmup))
    if not args.json:
        return run_command(child, options)
    # One JSON document: the run's own figures, and the agent's under "agent".
    seen: list[dict[str, Any]] = []
    with tempfile.TemporaryFile("w+") as child_out:
        code = run_command(child, options, stdout=child_out, on_summary=seen.append)
        child_out.seek(0)
        printed = child_out.read()
    if code != 0:
        return code
    try:
        result = json.loads(printed)
    except ValueError:
        raise UsageError("the workload printed no result", "run it without --attach to see "
                         "why") from None
    result["agent"] = seen[0] if seen else None
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    return 0


def run_command(args: argparse.Namespace, out: TextIO) -> int:
    from dlprof_agent.workloads.runner import run

    if args.attach:
        return _attached(args)
    _check_device(args.framework, args.device)
    if args.ranks > 1:
        return _distributed_command(args, out)
    config = _config(args)
    from dlprof_agent.workloads.datasets import DatasetError

    try:
        result = run(config, _progress(f"{args.framework} {args.model}")
                     if args.progress else None)
    except DatasetError as error:
        raise UsageError(f"cannot use the data: {error}", "check --data") from None
    except (ValueError, RuntimeError) as error:
        raise refusal(args, error) from None
    if args.json:
        out.write(json.dumps(result.as_dict(), indent=2) + "\n")
        return 0
    out.write(
        f"{args.framework} {args.model} on {args.device}, batch {result.batch_size}, "
        f"{len(result.step_seconds)} timed iterations after {config.warmup} warm-up, "
        f"layout {config.resolved_layout()}, {config.precision}\n"
        f"  time per mini-batch  {result.seconds_per_batch * 1000:.2f} ms (median)\n"
        f"  samples per second   {result.samples_per_second:.1f}\n"
        f"  peak memory          {result.peak_rss_bytes / 2**20:.0f} MiB resident"
        + (f", {result.peak_device_memory_bytes / 2**20:.0f} MiB on the GPU"
           if result.peak_device_memory_bytes is not None else "") + "\n"
        f"  parameters           {result.parameters:,}\n")
    return 0


def _chosen_settings(args: argparse.Namespace) -> list[str]:
    """The settings given that change how the framework computes, as options."""
    chosen = [f"--precision {args.precision}"] if args.precision != "fp32" else []
    chosen += [f"--layout {args.layout}"] if args.layout else []
    chosen += ["--cudnn-autotune"] if args.cudnn_autotune else []
    chosen += ["--input-grad"] if args.input_grad else []
    return chosen


def refusal(args: argparse.Namespace, error: BaseException) -> UsageError:
    """A setting the framework refuses, as a one-line error that names the setting."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else repr(error)
    if (args.precision == "amp" and args.device == "cpu"
            and "primitive descriptor" in first):
        # oneDNN has no bfloat16 kernel for this layer on CPUs without AVX512-BF16 or AMX.
        return UsageError(f"{args.framework} cannot train {args.model} with --precision amp "
                          "on this CPU: its oneDNN has no bfloat16 kernel for it here",
                          "use --precision fp32 (the default)")
    chosen = _chosen_settings(args)
    where = f"with {' '.join(chosen)}" if chosen else "with the default settings"
    return UsageError(f"{args.framework} cannot train {args.model} {where} on {args.device}: "
                      f"{first[:300]}", "change " + ("those settings" if chosen else
                                                     "the settings") + " (see --help)")


def _base_run_args(args: argparse.Namespace) -> list[str]:
    """The `workload run` options the sweep holds fixed."""
    base = ["--framework", args.framework, "--model", args.model, "--device", args.device,
            "--iterations", str(args.iterations), "--warmup", str(args.warmup),
            "--precision", args.precision, "--scale", args.scale]
    for option, value in (("--batch-size", args.batch_size), ("--threads", args.threads),
                          ("--inter-op-threads", args.inter_op_threads),
                          ("--layout", args.layout)):
        if value is not None:
            base += [option, str(value)]
    base += ["--cudnn-autotune"] if args.cudnn_autotune else []
    base += ["--input-grad"] if args.input_grad else []
    base += ["--data", args.data] if args.data else []
    base += ["--data-delay", str(args.data_delay)] if args.data_delay else []
    return base


def _sweep_run_args(args: argparse.Namespace) -> list[str]:
    base = _base_run_args(args)
    if args.attach:
        base += ["--attach", "--interval", str(args.interval)]
    return base


def sweep_command(args: argparse.Namespace, out: TextIO) -> int:
    from pathlib import Path

    from dlprof_agent.workloads import sweep

    try:
        params = [sweep.parse_param(text) for text in args.param]
    except sweep.SweepError as error:
        raise UsageError(str(error), "see dlprof-agent workload sweep --help") from None
    names = [name for name, _ in params]
    if len(set(names)) != len(names):
        raise UsageError("a setting is swept twice", "give each --param name once")
    _check_device(args.framework, args.device)
    points = sweep.grid(params)
    runs = [(index, round_) for round_ in range(args.repeat) for index in range(len(points))]
    progress = _progress("sweep")
    measured: list[list[dict[str, Any]]] = [[] for _ in points]
    for done, (index, round_) in enumerate(runs):
        point = points[index]
        if progress is None:
            label = f" (round {round_ + 1}/{args.repeat})" if args.repeat > 1 else ""
            out.write(f"[{done + 1}/{len(runs)}] {point}{label}\n")
            out.flush()
        else:
            progress(done, len(runs))
        try:
            measured[index].append(sweep.run_point(_sweep_run_args(args), point))
        except sweep.SweepError as error:
            raise UsageError(str(error), "fix that setting, or leave it out") from None
    if progress is not None:
        progress(len(runs), len(runs))
    rows = [sweep.combine_repeats(point_runs) if args.repeat > 1 else point_runs[0]
            for point_runs in measured]
    target = Path(args.out) if args.out else sweep.default_out_dir()
    written = sweep.write_results(rows, names, target)
    out.write((target / "table.md").read_text())
    out.write("wrote " + ", ".join(str(path) for path in written) + "\n")
    if not any(path.suffix == ".png" for path in written):
        out.write("(no plot: install matplotlib, e.g. pip install 'dlprof-agent[plots]')\n")
    return 0


def workload_command(args: argparse.Namespace, out: TextIO) -> int:
    if args.workload_command == "sweep":
        return sweep_command(args, out)
    if args.workload_command == "run":
        return run_command(args, out)
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
    return 0

