"""`dlprof-agent snapshot PID`: print the metrics of a process once and exit."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dlprof_agent.agent.serve import snapshot_command
from dlprof_agent.cli.arguments import paragraph, pid
from dlprof_agent.cli.options import add_sampling_options
from dlprof_agent.errors import EXIT_CODES_HELP


def add_parser(commands: Any) -> None:
    snapshot = commands.add_parser(
        "snapshot", help="print the metrics of a process once and exit",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=paragraph("Take one sample of PID and print it in the Prometheus text "
                    "format, for scripts and quick checks. Counters are totals since the "
                    "process started; rates need two snapshots or a Prometheus server."),
        epilog="examples:\n"
               "  dlprof-agent snapshot 4242\n"
               "  dlprof-agent snapshot 4242 | grep dlprof_thread_group\n"
               "  dlprof-agent snapshot 4242 | promtool check metrics\n\n"
               + EXIT_CODES_HELP)
    snapshot.add_argument("pid", type=pid, metavar="PID", help="the process id")
    add_sampling_options(snapshot)


def run(args: argparse.Namespace) -> int:
    return snapshot_command(args.pid, children=args.children, gpu=args.gpu, out=sys.stdout)
