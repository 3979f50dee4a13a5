"""`dlprof-agent rules`: print Prometheus's rules file for the agent's metrics, with
the rate window, `for` duration and scrape job chosen; the rules themselves are
exporters/prometheus_rules.py's."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dlprof_agent.cli.arguments import paragraph
from dlprof_agent.errors import ExitCode, UsageError, exit_codes_help
from dlprof_agent.exporters.prometheus_rules import (
    AGENT_DOWN_ALERT,
    CAUSES,
    DEFAULT_FOR,
    DEFAULT_RATE_WINDOW,
    DEFAULT_SCRAPE_JOB,
    MISSING_RANKS_ALERT,
    PROBE_DOWN_ALERT,
    SLOW_EXCHANGE_ALERT,
    STALLED_ALERT,
    STEP_WINDOW,
    STEP_WINDOW_MIN_STEPS,
    STRAGGLER_ALERT,
    STRAGGLER_FLOOR_SECONDS,
    STRAGGLER_FOR,
    STRAGGLER_STEP_SHARE,
    RuleOptions,
    duration_ms,
    rules_file,
)

EXIT_CODES = exit_codes_help(
    (ExitCode.FINISHED, ExitCode.USAGE),
    {ExitCode.FINISHED: "written",
     ExitCode.USAGE: "bad arguments, or --output cannot be written"})


def _duration(text: str) -> str:
    try:
        duration_ms(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _window(text: str) -> str:
    if duration_ms(_duration(text)) <= 0:
        raise argparse.ArgumentTypeError(f"{text} holds no samples: give e.g. 1m")
    return text


def add_parser(commands: Any) -> None:
    rules = commands.add_parser(
        "rules", help="print the Prometheus recording rules and alerts for the agent",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=paragraph(
            "Print the rules file Prometheus loads beside the agent's scrape "
            "(rule_files: in prometheus.yml): the recording rules the dashboards read, "
            "each job's throughput and per-rank time split (own time, the wait in "
            "collectives, input), step skew, exchange share, a scaling-efficiency "
            "estimate, and alerts. With the defaults it is deploy/prometheus/rules.yml "
            "as shipped.") + "\n\n" + paragraph(
            f"A rank is a straggler when its own time per step (step time less the time "
            f"it waited in collectives) is above its job's median by "
            f"--straggler-share ({STRAGGLER_STEP_SHARE:.0%}) of the job's median step time, and "
            f"{STRAGGLER_FLOOR_SECONDS * 1000:g} ms, for --straggler-for; each rank's "
            f"figures per step are over the last {STEP_WINDOW} when it ended "
            f"{STEP_WINDOW_MIN_STEPS} steps in it, else over --rate-window; "
            f"the alert {STRAGGLER_ALERT} names it (labels job_id, rank) and its cause "
            f"(label cause: {', '.join(CAUSES)}). Also: {SLOW_EXCHANGE_ALERT}, "
            f"{STALLED_ALERT}, {MISSING_RANKS_ALERT}, {AGENT_DOWN_ALERT}, {PROBE_DOWN_ALERT}. "
            "docs/fleet.md explains each."),
        epilog="examples:\n"
               "  dlprof-agent rules -o /etc/prometheus/dlprof-rules.yml\n"
               "  dlprof-agent rules --rate-window 5m --for 10m    scrapes every 15-60 s\n"
               "  dlprof-agent rules --rate-window 10s --for 10s   a quick test\n"
               "  dlprof-agent rules | promtool check rules /dev/stdin\n\n"
               "The window should span at least four scrape intervals; a shorter --for "
               "fires sooner\nand on shorter blips. Prometheus rereads the file on "
               "SIGHUP or POST /-/reload.\n\n" + EXIT_CODES)
    rules.add_argument("--rate-window", type=_window, default=DEFAULT_RATE_WINDOW,
                       metavar="DURATION",
                       help="the range of rate() in the job's rules and of the stalled "
                            f"check, a Prometheus duration (default {DEFAULT_RATE_WINDOW}); "
                            "the dashboards' own 1m rules keep 1m")
    rules.add_argument("--for", dest="for_", type=_duration, default=DEFAULT_FOR,
                       metavar="DURATION",
                       help="how long a condition must hold before its alert fires "
                            f"(default {DEFAULT_FOR}), but for the next")
    rules.add_argument("--straggler-for", type=_duration, default=STRAGGLER_FOR,
                       metavar="DURATION",
                       help=f"the same for {STRAGGLER_ALERT} "
                            f"(default {STRAGGLER_FOR})")
    rules.add_argument("--straggler-share", type=float, default=STRAGGLER_STEP_SHARE,
                       metavar="SHARE",
                       help="how far above its job's median a rank's own time per step "
                            "must be, as a share of the median step time, to be named a "
                            f"straggler (default {STRAGGLER_STEP_SHARE:g}; lower it where "
                            "healthy ranks stay closer together than on a shared machine)")
    rules.add_argument("--scrape-job", default=DEFAULT_SCRAPE_JOB, metavar="REGEX",
                       help=f"the `job` label of the agents' scrape, for {AGENT_DOWN_ALERT} "
                            f"(default {DEFAULT_SCRAPE_JOB}: the shipped prometheus.yml "
                            "and ServiceMonitor)")
    rules.add_argument("-o", "--output", type=Path, metavar="FILE",
                       help="write the file there instead of to standard output")


def rules_command(args: argparse.Namespace) -> int:
    try:
        options = RuleOptions(rate_window=args.rate_window, for_=args.for_,
                              straggler_for=args.straggler_for,
                              straggler_share=args.straggler_share, scrape_job=args.scrape_job)
    except ValueError as error:
        raise UsageError(str(error), "see dlprof-agent rules --help") from None
    text = rules_file(options)
    if args.output is None:
        sys.stdout.write(text)
        return ExitCode.FINISHED
    try:
        args.output.write_text(text, encoding="utf-8")
    except OSError as error:
        raise UsageError(f"cannot write {args.output}: {error.strerror or error}",
                         "give a path in a folder you can write to") from None
    return ExitCode.FINISHED


def run(args: argparse.Namespace) -> int:
    return rules_command(args)
