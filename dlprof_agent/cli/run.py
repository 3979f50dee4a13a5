"""`run`: start a training command with the probe loaded, attach to it as
`attach` does, and exit with the command's own exit code."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TextIO

from dlprof_agent.agent.serve import ServeOptions, serve
from dlprof_agent.cli.arguments import paragraph
from dlprof_agent.cli.options import (
    add_probe_options,
    add_sampling_options,
    add_serving_options,
    probe_options,
    serve_options,
)
from dlprof_agent.errors import EXIT_CODES_HELP, TargetNotFound, UsageError
from dlprof_agent.probe_link.connect import ProbeOptions

# How long the started command has to load its probe (Python's start-up and the
# script's first imports) before it is measured from outside only.
RUN_PROBE_WAIT_SECONDS = 10.0


def run_command(command_line: list[str], options: ServeOptions, *,
                stdout: TextIO | None = None,
                on_summary: Callable[[dict[str, Any]], None] | None = None) -> int:
    """``stdout``: where the command's output goes (default: the agent's own)."""
    if command_line and command_line[0] == "--":
        command_line = command_line[1:]
    if not command_line:
        raise UsageError("no command to run", "put it after --, e.g. "
                         "dlprof-agent run -- python train.py")
    from dlprof_agent.agent.endpoint import check_can_listen
    from dlprof_agent.probe.bootstrap import preload_environment

    if options.serve_metrics:
        check_can_listen(options.listen, options.port)  # a busy port stops nothing started
    try:
        job = subprocess.Popen(command_line, env=preload_environment(dict(os.environ)),
                               stdout=stdout)
    except OSError as error:
        raise UsageError(f"cannot start {command_line[0]!r}: {error.strerror}",
                         "check the command and its path") from None
    attached = False
    try:
        probe = _wait_for_probe_or_exit(job, options)
        if job.poll() is None:
            serve(job.pid, replace(options, probe=probe, probe_wait_seconds=1.0),
                  on_summary=on_summary, describe_exit=lambda: _ended(job))
            attached = True
    except TargetNotFound:
        pass  # the command ended before the agent attached: said below, with its code
    except BaseException:
        job.terminate()
        raise
    # The job's life is the run's: wait for it, and hand on its exit code.
    code = job.wait()
    if not attached:
        print(f"dlprof-agent: {_ended(job)} before the agent attached; nothing was "
              "measured", file=sys.stderr)
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says


def _ended(job: subprocess.Popen[bytes]) -> str:
    """How the command of `run` ended, once the agent saw it go."""
    try:
        code = job.wait(5)  # gone from the samples: a zombie, reaped at once
    except subprocess.TimeoutExpired:
        return f"the command (pid {job.pid}) is no longer seen"
    if code < 0:
        return f"the command (pid {job.pid}) was killed by signal {-code}"
    return f"the command (pid {job.pid}) exited with code {code}"


def _wait_for_probe_or_exit(job: subprocess.Popen[bytes], options: ServeOptions
                            ) -> ProbeOptions | None:
    """The probe options to attach with: None (measured from outside only) when no
    probe was asked for or it did not start in time. Returns early if the job ends."""
    if options.probe is None:
        return None
    from dlprof_agent.probe_link.client import find_probe_socket

    deadline = time.monotonic() + RUN_PROBE_WAIT_SECONDS
    while job.poll() is None:
        if find_probe_socket(job.pid) is not None:
            return options.probe
        if time.monotonic() >= deadline:
            print(f"dlprof-agent: no in-process metrics (steps, layers) for pid {job.pid}: "
                  f"its probe did not start within {RUN_PROBE_WAIT_SECONDS:g} s (not a "
                  "Python 3.10+ program, or it replaced PYTHONPATH); measuring it from "
                  "outside", file=sys.stderr)
            return None
        time.sleep(0.05)
    return None


def add_parser(commands: Any) -> None:
    run = commands.add_parser(
        "run", help="start a training command with the probe loaded, and attach to it",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=paragraph("Start COMMAND with the in-process probe loaded before the "
                    "script's own code (through a sitecustomize on PYTHONPATH, which chains "
                    "to any of the job's own; the script is not changed), then attach to "
                    "it as `attach` does. Exits with the command's exit code."),
        epilog="examples:\n"
               "  dlprof-agent run -- python train.py --epochs 3\n"
               "  dlprof-agent run --layers --port 9946 -- python train.py\n\n"
               + EXIT_CODES_HELP)
    run.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                     help="the training command, after --")
    add_serving_options(run, duration_default=None)
    add_sampling_options(run)
    add_probe_options(run, injects=False)


def run(args: argparse.Namespace) -> int:
    return run_command(args.command_line, serve_options(args, probe_options(args)))
