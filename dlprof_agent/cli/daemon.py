"""`dlprof-agent daemon`: one agent per node, watching every GPU job and every job
with the probe; the watching is agent/daemon.py's."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from dlprof_agent.agent.endpoint import load_web_config
from dlprof_agent.agent.exit_totals import DEFAULT_GRACE_SECONDS
from dlprof_agent.agent.status import configure_logging
from dlprof_agent.cli.arguments import (
    environment_pair,
    paragraph,
    regex,
    seconds,
    whole_number,
)
from dlprof_agent.cli.options import (
    add_probe_options,
    add_serving_options,
    probe_options,
    resolved_node_name,
)
from dlprof_agent.errors import EXIT_CODES_HELP
from dlprof_agent.probe_link.series_budget import DEFAULT_AGENT_SERIES

log = logging.getLogger("dlprof_agent")


def add_parser(commands: Any) -> None:
    daemon = commands.add_parser(
        "daemon", help="watch this node: attach to every GPU job and every job with the probe",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=paragraph("One agent per node, for a Kubernetes DaemonSet, a systemd unit "
                    "or a SLURM prolog. Every --scan-interval seconds it looks for jobs: "
                    "processes with a context on a GPU (through NVML), processes that loaded "
                    "the in-process probe (dlprof-agent run, or dlprof_agent.probe.enable()), "
                    "and processes whose command line matches --match. It reads each as "
                    "`attach` does, with the probe where it can, serves them all on one "
                    "/metrics (each process under its own pid label), and drops each job "
                    "when it exits: its series are gone from the next scrape."),
        epilog="examples:\n"
               "  dlprof-agent daemon --listen 0.0.0.0\n"
               "  dlprof-agent daemon --match 'python .*train' --layers\n"
               "  dlprof-agent daemon --env SLURM_JOB_ID=$SLURM_JOB_ID --match python "
               "--port 9951\n"
               "  dlprof-agent daemon --match torchrun --node-name $(hostname -s)\n\n"
               "Each job's ranks are targets of their own, even under a watched launcher\n"
               "(torchrun, srun): a process whose environment carries RANK, SLURM_PROCID\n"
               "or TF_CONFIG. dlprof_target_info says who each is (job_id, rank, node,\n"
               "pod); docs/fleet-identity.md says where each label comes from.\n\n"
               "Reading other users' processes needs root, or CAP_SYS_PTRACE (and\n"
               "CAP_DAC_OVERRIDE to reach their probe sockets); see docs/deploy.md for\n"
               "Kubernetes, systemd and SLURM.\n\n"
               + EXIT_CODES_HELP)
    add_serving_options(daemon, duration_default=None, one_target=False)
    daemon.add_argument("--max-series", type=whole_number(1000, unit="series"),
                        default=DEFAULT_AGENT_SERIES, metavar="N",
                        help=f"series all jobs together may add (default {DEFAULT_AGENT_SERIES:,}"
                             "); past it the widest jobs are folded first, down to an equal "
                             "share")
    daemon.add_argument("--scan-interval", type=seconds(0.1), default=2.0, metavar="SECONDS",
                        help="how often to look for new jobs (default 2)")
    daemon.add_argument("--grace", type=seconds(0), default=DEFAULT_GRACE_SECONDS,
                        metavar="SECONDS",
                        help="after a job exits, keep serving its dlprof_target_up 0 and "
                             "final totals this long, so the last scrape sees every step "
                             f"(default {DEFAULT_GRACE_SECONDS:g})")
    daemon.add_argument("--match", action="append", type=regex, default=[], metavar="REGEX",
                        help="also watch processes whose command line matches (repeatable), "
                             "e.g. 'python .*train'")
    daemon.add_argument("--env", action="append", type=environment_pair, default=[],
                        metavar="NAME=VALUE",
                        help="watch only processes whose environment has NAME=VALUE "
                             "(repeatable), e.g. SLURM_JOB_ID=1234")
    daemon.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=True,
                        help="read GPUs and find GPU jobs through NVML (default: on)")
    add_probe_options(daemon, injects=True)


def run(args: argparse.Namespace) -> int:
    from dlprof_agent.agent.daemon import serve_node
    from dlprof_agent.agent.discovery import DaemonOptions
    from dlprof_agent.agent.heap import return_large_buffers

    return_large_buffers()  # tenants' replies are megabytes: their buffers go back

    configure_logging(None)
    if args.quiet:
        log.setLevel(logging.WARNING)
    web = load_web_config(args.web_config_file)
    options = DaemonOptions(interval=args.interval, scan_interval=args.scan_interval,
                            matches=tuple(args.match), environment=tuple(args.env),
                            probe=probe_options(args), gpu=args.gpu,
                            max_series_per_target=args.max_series_per_target,
                            max_series=args.max_series, grace=args.grace,
                            node_name=resolved_node_name(args.node_name))
    return serve_node(options, args.listen, args.port, web, args.max_requests)
