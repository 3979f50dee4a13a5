"""`dlprof-agent workload run` (one reference model trained and timed, alone, over
several ranks, or under the agent with --attach) and `workload sweep` (a grid of
such runs, each in a fresh process, written out as results, a table and plots)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any, TextIO

from dlprof_agent.errors import ExitCode, UsageError

# How long an attached run holds its first step for the agent's probe.
PROBE_WAIT_SECONDS = 30.0


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
        return ExitCode.FINISHED
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
    return ExitCode.FINISHED


def _attached(args: argparse.Namespace) -> int:
    """The same `workload run`, minus --attach, as a child the agent attaches to."""
    from dlprof_agent.agent.endpoint import DEFAULT_LISTEN
    from dlprof_agent.agent.serve import ServeOptions
    from dlprof_agent.cli.run import run_command as run_under_agent
    from dlprof_agent.probe_link.connect import ProbeOptions

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
        return run_under_agent(child, options)
    # One JSON document: the run's own figures, and the agent's under "agent".
    seen: list[dict[str, Any]] = []
    with tempfile.TemporaryFile("w+") as child_out:
        code = run_under_agent(child, options, stdout=child_out, on_summary=seen.append)
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
    return ExitCode.FINISHED


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
        return ExitCode.FINISHED
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
    return ExitCode.FINISHED


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
    return ExitCode.FINISHED
