"""`probe-copy DIR`: put the probe where a job whose image lacks the package can
load it at launch (a Kubernetes init container's shared volume, a shared file
system for SLURM). The job then sets PYTHONPATH=DIR and DLPROF_PROBE=1."""

from __future__ import annotations

import argparse
import os
from typing import Any

from dlprof_agent.cli.arguments import paragraph
from dlprof_agent.errors import EXIT_CODES_HELP, UsageError


def add_parser(commands: Any) -> None:
    copy = commands.add_parser(
        "probe-copy", help="copy the probe into a folder for jobs started with DLPROF_PROBE=1",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=paragraph("Copy the in-process probe (the standard library only) and a "
                    "sitecustomize that starts it into DIR. A job with DIR on its "
                    "PYTHONPATH and DLPROF_PROBE=1 in its environment starts the probe "
                    "asleep before its script's code, keeping its own sitecustomize; a "
                    "daemon then reads it without injection (--no-inject). Images that "
                    "install dlprof-agent need no copy: the variable alone does it."),
        epilog="examples:\n"
               "  dlprof-agent probe-copy /dlprof-probe    (an init container)\n"
               "  PYTHONPATH=/dlprof-probe DLPROF_PROBE=1 python train.py\n\n"
               + EXIT_CODES_HELP)
    copy.add_argument("directory", metavar="DIR", help="where to copy it (made if missing)")


def run(args: argparse.Namespace) -> int:
    from dlprof_agent.probe.bootstrap import copy_probe

    try:
        written = copy_probe(args.directory)
    except OSError as error:
        raise UsageError(f"cannot copy the probe into {args.directory!r}: "
                         f"{error.strerror or error}",
                         "give a folder this user may write (a mounted volume)") from None
    print(f"copied {len(written)} files into {os.path.abspath(args.directory)}; start the "
          "job with PYTHONPATH=" f"{os.path.abspath(args.directory)} DLPROF_PROBE=1")
    return 0
