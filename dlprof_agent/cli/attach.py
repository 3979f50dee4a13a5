"""`dlprof-agent attach PID`: sample a running process and serve its metrics."""

from __future__ import annotations

import argparse
from typing import Any

from dlprof_agent.agent.endpoint import DEFAULT_PORT
from dlprof_agent.agent.serve import serve
from dlprof_agent.cli.arguments import paragraph, pid
from dlprof_agent.cli.options import (
    add_probe_options,
    add_sampling_options,
    add_serving_options,
    probe_options,
    serve_options,
)
from dlprof_agent.errors import EXIT_CODES_HELP


def add_parser(commands: Any) -> None:
    attach = commands.add_parser(
        "attach", help="sample a running process and serve its metrics",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=paragraph("Sample the process PID (and its descendants) every --interval "
                    "seconds and serve the latest sample on /metrics for Prometheus, plus "
                    "/healthz. On a terminal a status line shows the CPU split, memory, "
                    "threads and GPU use; on exit a summary is printed. If PID is a Python "
                    "process, the in-process probe is used (when the job started one) or "
                    "injected, for step time, samples per second, per-layer time (--layers) "
                    "and framework settings; Ctrl-C removes its hooks again. A process that "
                    "is not Python is still measured from outside."),
        epilog="examples:\n"
               "  dlprof-agent attach 4242\n"
               "  dlprof-agent attach $(pgrep -f train.py) --port 9946 --interval 0.5\n"
               "  dlprof-agent attach 4242 --listen 0.0.0.0 --no-children --duration 600\n"
               "  dlprof-agent attach 4242 --layers --warmup-steps 20\n\n"
               "Prometheus scrape config:\n"
               "  scrape_configs:\n"
               "    - job_name: dlprof\n"
               "      scrape_interval: 1s\n"
               f"      static_configs: [{{targets: ['localhost:{DEFAULT_PORT}']}}]\n\n"
               "How the probe gets into a running job: Python 3.14 runs it itself (PEP 768). "
               "On 3.9-3.13\non x86-64 and arm64 the agent borrows one thread of the job, "
               "which returns to where it\nwas through a signal frame of its own: a kill "
               "of the agent at any instant leaves the job\nas it was. Elsewhere gdb is "
               "the last resort; its calls return to a breakpoint of its own, so\na kill "
               "of gdb in those milliseconds kills the job. --no-inject avoids it: start "
               "the job\nwith `dlprof-agent run -- ...` or DLPROF_PROBE=1 instead "
               "(docs/reach.md).\n\n"
               "Reading another user's process needs root with CAP_SYS_PTRACE. Injecting "
               "the probe needs\nthe job's user, or CAP_SYS_PTRACE where Yama's "
               "ptrace_scope is 1 or more (in a container:\n--cap-add SYS_PTRACE).\n\n"
               + EXIT_CODES_HELP)
    attach.add_argument("pid", type=pid, metavar="PID", help="the training job's process id")
    add_serving_options(attach, duration_default=None)
    add_sampling_options(attach)
    add_probe_options(attach, injects=True)


def run(args: argparse.Namespace) -> int:
    return serve(args.pid, serve_options(args, probe_options(args)))
