"""The entry point of the benchmark suite.

    python -m benchmarks.run NAME [--smoke] [--out DIR] [options]
    python -m benchmarks.run NAME --help        what NAME measures, its options, its targets

Each benchmark writes NAME.md (tables, targets met or missed, the machine, the
date, the command and how noisy the machine was) and NAME.json (the same
figures, raw) into --out (default docs/results; with --smoke, build/benchmarks-smoke).
--smoke runs a few seconds to check that the harness works: its figures mean
nothing. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks import (
    footprint,
    launch,
    overhead,
    probe_throughput,
    scaling,
    scrape,
    stragglers,
    top,
)
from benchmarks.common import (
    DEFAULT_OUT,
    SMOKE_OUT,
    Result,
    add_options,
    code_state,
    rerun_command,
    resolve,
)
from benchmarks.common import write_result as write

BENCHMARKS: dict[str, ModuleType] = {module.NAME: module for module in (
    overhead, footprint, scrape, probe_throughput, scaling, launch, stragglers, top)}


def build_parser() -> argparse.ArgumentParser:
    listing = "\n".join(f"  {name:<10} {module.TARGETS}" for name, module in BENCHMARKS.items())
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__, epilog="targets (each result marks them met or missed):\n"
        + listing)
    commands = parser.add_subparsers(dest="name", metavar="NAME", required=True)
    for name, module in [*BENCHMARKS.items(), ("all", None)]:
        doc = module.__doc__ if module is not None else "Every benchmark in turn."
        sub = commands.add_parser(
            name, help=(module.SUMMARY.replace("%", "%%") if module is not None
                        else "every benchmark in turn"),
            formatter_class=argparse.RawDescriptionHelpFormatter, description=doc,
            epilog=f"targets: {module.TARGETS}" if module is not None else None)
        sub.add_argument("--smoke", action="store_true",
                         help="a few seconds, to check the harness works (figures mean nothing)")
        sub.add_argument("--out", type=Path, default=None, metavar="DIR",
                         help="where NAME.md and NAME.json go (default docs/results; with "
                              "--smoke, build/benchmarks-smoke)")
        if module is not None:
            add_options(sub, module.OPTIONS)
    return parser


def run_one(name: str, args: argparse.Namespace, argv: Sequence[str]) -> Result:
    module = BENCHMARKS[name]
    settings = {**resolve(args, module.OPTIONS), "smoke": args.smoke}
    out: Path = args.out or (SMOKE_OUT if args.smoke else DEFAULT_OUT)
    started = datetime.datetime.now(datetime.timezone.utc)
    clock = time.monotonic()
    runner: Callable[[dict[str, Any]], Result] = module.run
    code = code_state(getattr(module, "MEASURES", ("dlprof_agent", f"benchmarks/{name}.py")))
    result = runner(settings)
    result.code = code
    words = list(argv) if args.name == name else [name, *(["--smoke"] if args.smoke else [])]
    md, js = write(result, out, rerun_command(words, out, SMOKE_OUT if args.smoke
                                              else DEFAULT_OUT),
                   started, time.monotonic() - clock)
    print(f"{name}: wrote {md} and {js}")
    for target in result.targets:
        verdict = "n/a" if target.met is None else "met" if target.met else "MISSED"
        print(f"  {verdict:<6} {target.name}: {target.target}; measured {target.measured}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    # Run in the background (nohup, &), Python starts with SIGINT ignored and its
    # children inherit that; py-spy and the busy targets stop on SIGINT.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    names = list(BENCHMARKS) if args.name == "all" else [args.name]
    for name in names:
        run_one(name, args, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
