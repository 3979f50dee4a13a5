"""The ``dlprof-agent`` command line: the top parser, a subcommand from each module
of cli/, and main(), which hands each command line to its module's ``run`` and prints
a deliberate error in one line."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, Protocol

from dlprof_agent import __version__
from dlprof_agent.agent.endpoint import DEFAULT_LISTEN, DEFAULT_PORT
from dlprof_agent.agent.loop import StopRequested, sigterm_stops
from dlprof_agent.cli import (
    attach,
    daemon,
    demo,
    grafana,
    probe_copy,
    run,
    snapshot,
    top,
    trace,
    workload,
)
from dlprof_agent.cli import rules as rules_command
from dlprof_agent.cli.arguments import OneLineErrorParser, paragraph
from dlprof_agent.errors import EXIT_CODES_HELP, DlprofError, ExitCode

# What a shell reports for a command ended by Ctrl-C (SIGINT).
EXIT_INTERRUPTED = 128 + signal.SIGINT


class Command(Protocol):
    """What each command module of cli/ has."""

    def add_parser(self, commands: Any) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


# In the order `--help` lists them.
COMMANDS: dict[str, Command] = {
    "attach": attach, "top": top, "run": run, "snapshot": snapshot, "demo": demo,
    "daemon": daemon, "trace": trace, "workload": workload, "grafana": grafana,
    "rules": rules_command, "probe-copy": probe_copy,
}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="dlprof-agent",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=paragraph("Attach to a running training job and export where its time "
                    "goes to Prometheus: CPU by mode, memory, threads, context switches, "
                    "I/O, and GPU utilization, memory, PCIe, power and clocks, read from "
                    "outside; and, from a small probe inside a Python job, step time, "
                    "samples per second, per-layer time and the framework's settings. The "
                    "job is not restarted."),
        epilog="examples:\n"
               "  dlprof-agent attach $(pgrep -f train.py)     serve on "
               f"http://{DEFAULT_LISTEN}:{DEFAULT_PORT}/metrics\n"
               "  dlprof-agent top $(pgrep -f train.py)        the same, on one live "
               "screen\n"
               "  dlprof-agent run -- python train.py           start a job with the probe\n"
               "  dlprof-agent snapshot 4242 | grep cpu        print the metrics once\n"
               "  dlprof-agent trace 4242 --steps 5            5 steps of kernels, as a "
               "timeline\n"
               "  dlprof-agent demo                            see it work on a busy process\n"
               "\nrun `dlprof-agent COMMAND --help` for each command's options.\n\n"
               + EXIT_CODES_HELP)
    parser.add_argument("--version", action="version", version=f"dlprof-agent {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND",
                                     parser_class=OneLineErrorParser)
    for command in COMMANDS.values():
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return ExitCode.USAGE
    try:
        # From the first instant: a SIGTERM during start-up unwinds what was
        # started (the probe first) instead of killing the agent where it stands.
        with sigterm_stops():
            return COMMANDS[args.command].run(args)
    except StopRequested:
        print("dlprof-agent: stopped by SIGTERM", file=sys.stderr)
        return ExitCode.FINISHED
    except DlprofError as error:
        print(f"dlprof-agent: error: {error.one_line()}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("dlprof-agent: stopped by Ctrl-C", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `dlprof-agent snapshot PID | head`: the reader left; that is not a failure.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.FINISHED


def exit_with(code: int) -> NoReturn:
    """Leave the process with ``code`` once a command has cleaned up: its threads
    (the server's, a probe read) are not torn down by the interpreter's exit in
    the middle of a native call, which aborts the process (SIGABRT)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def entry() -> NoReturn:
    """The ``dlprof-agent`` program."""
    exit_with(main())
