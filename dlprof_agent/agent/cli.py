"""The ``dlprof-agent`` command line: the parser, and main() that hands each
command to the module that does it and prints a deliberate error in one line."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence

from dlprof_agent import __version__
from dlprof_agent.agent import grafana_cli, trace_cli, workload_cli
from dlprof_agent.agent.arguments import (
    OneLineErrorParser,
    budget_fraction,
    environment_pair,
    pid,
    port,
    regex,
    seconds,
    whole_number,
)
from dlprof_agent.agent.arguments import paragraph as _para
from dlprof_agent.agent.demo import demo_command
from dlprof_agent.agent.endpoint import DEFAULT_LISTEN, DEFAULT_PORT, load_web_config
from dlprof_agent.agent.reach.connect import ProbeOptions
from dlprof_agent.agent.run import run_command
from dlprof_agent.agent.serve import (
    DEFAULT_GRACE_SECONDS,
    DEFAULT_INTERVAL_SECONDS,
    DEFAULT_WARMUP_STEPS,
    MIN_INTERVAL_SECONDS,
    ServeOptions,
    serve,
    snapshot_command,
)
from dlprof_agent.agent.status import configure_logging
from dlprof_agent.errors import EXIT_CODES_HELP, DlprofError, ExitCode

# What a shell reports for a command ended by Ctrl-C (SIGINT).
EXIT_INTERRUPTED = 128 + signal.SIGINT

log = logging.getLogger("dlprof_agent")


def _add_sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--children", action=argparse.BooleanOptionalAction, default=True,
                        help="also read the target's descendants (launcher ranks, data-loader "
                             "workers), each as its own pid (default: on)")
    parser.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=True,
                        help="read GPUs through NVML when a driver is present (default: on)")


def _add_probe_options(parser: argparse.ArgumentParser, *, injects: bool) -> None:
    group = parser.add_argument_group(
        "in-process probe", "step time, samples per second, per-layer time and framework "
        "settings, measured inside the job")
    group.add_argument("--layers", action="store_true",
                       help="also time each layer's forward and backward, in a share of the "
                            "steps chosen to stay within --layers-budget; the other steps run "
                            "without hooks (off by default)")
    group.add_argument("--layers-budget", type=budget_fraction, default=0.01,
                       metavar="SHARE",
                       help="step time --layers may add, as a percentage (1%%) or a fraction "
                            "(0.01): the probe measures what a timed step costs and times one "
                            "step in as many as that allows (default 1%%)")
    group.add_argument("--layers-every", type=whole_number(1, 1000, unit="steps"),
                       metavar="N",
                       help="time the layers of one step in N, whatever it costs (1: every "
                            "step); overrides --layers-budget")
    group.add_argument("--warmup-steps", type=whole_number(0, unit="steps"),
                       default=DEFAULT_WARMUP_STEPS, metavar="N",
                       help="steps counted as warm-up and kept out of the steady-state "
                            f"figures (default {DEFAULT_WARMUP_STEPS})")
    group.add_argument("--no-kernels", dest="kernels", action="store_false",
                       help="no continuous CUPTI kernel and memcpy tracing in GPU jobs (on by "
                            "default when the job has cupti-python; `trace` still works)")
    if injects:
        group.add_argument("--no-inject", dest="inject", action="store_false",
                           help="never inject the probe; use one only if the job started "
                                "it (run, or dlprof_agent.probe.enable())")
        group.add_argument("--no-probe", dest="probe", action="store_false",
                           help="out-of-process metrics only: do not talk to the job at all")


def _add_serving_options(parser: argparse.ArgumentParser, *, duration_default: float | None,
                         one_target: bool = True) -> None:
    parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="ADDRESS",
                        help=f"address to serve /metrics on (default {DEFAULT_LISTEN}; "
                             "0.0.0.0 for every interface)")
    parser.add_argument("--port", type=port, default=DEFAULT_PORT,
                        help=f"port to serve /metrics on (default {DEFAULT_PORT}; 0 picks a "
                             "free one)")
    parser.add_argument("--web.config.file", dest="web_config_file", metavar="FILE",
                        help="TLS and basic authentication for /metrics, in the web "
                             "configuration format of node_exporter and the other Prometheus "
                             "exporters (tls_server_config, basic_auth_users with bcrypt "
                             "hashes); see docs/deploy.md. Needs pip install "
                             "'dlprof-agent[web]'")
    parser.add_argument("--interval", type=seconds(MIN_INTERVAL_SECONDS),
                        default=DEFAULT_INTERVAL_SECONDS, metavar="SECONDS",
                        help="time between samples (default 1). Scrapes read the latest "
                             "sample and never trigger one")
    if not one_target:
        parser.add_argument("--quiet", action="store_true", help="log warnings only")
        return
    parser.add_argument("--duration", type=seconds(MIN_INTERVAL_SECONDS),
                        default=duration_default, metavar="SECONDS",
                        help="stop after this long" + (
                            f" (default {duration_default:g})" if duration_default
                            else " (default: until Ctrl-C or the target exits)"))
    parser.add_argument("--grace", type=seconds(0), default=DEFAULT_GRACE_SECONDS,
                        metavar="SECONDS",
                        help="after the target exits, keep serving dlprof_target_up 0 this "
                             f"long so the last scrape sees it (default {DEFAULT_GRACE_SECONDS:g})")
    parser.add_argument("--quiet", action="store_true",
                        help="no live status line and no summary")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="dlprof-agent",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_para("Attach to a running training job and export where its time goes to "
                    "Prometheus: CPU by mode, memory, threads, context switches, I/O, and "
                    "GPU utilization, memory, PCIe, power and clocks, read from outside; "
                    "and, from a small probe inside a Python job, step time, samples per "
                    "second, per-layer time and the framework's settings. The job is not "
                    "restarted."),
        epilog="examples:\n"
               "  dlprof-agent attach $(pgrep -f train.py)     serve on "
               f"http://{DEFAULT_LISTEN}:{DEFAULT_PORT}/metrics\n"
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

    attach = commands.add_parser(
        "attach", help="sample a running process and serve its metrics",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_para("Sample the process PID (and its descendants) every --interval seconds "
                    "and serve the latest sample on /metrics for Prometheus, plus /healthz. "
                    "On a terminal a status line shows the CPU split, memory, threads and "
                    "GPU use; on exit a summary is printed. If PID is a Python process, the "
                    "in-process probe is used (when the job started one) or injected, for "
                    "step time, samples per second, per-layer time (--layers) and framework "
                    "settings; Ctrl-C removes its hooks again. A process that is not Python "
                    "is still measured from outside."),
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
               "Reading another user's process needs root with CAP_SYS_PTRACE. Injecting "
               "the probe needs\nthe job's user, or CAP_SYS_PTRACE where Yama's "
               "ptrace_scope is 1 or more (in a container:\n--cap-add SYS_PTRACE).\n\n"
               + EXIT_CODES_HELP)
    attach.add_argument("pid", type=pid, metavar="PID", help="the training job's process id")
    _add_serving_options(attach, duration_default=None)
    _add_sampling_options(attach)
    _add_probe_options(attach, injects=True)

    run = commands.add_parser(
        "run", help="start a training command with the probe loaded, and attach to it",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_para("Start COMMAND with the in-process probe loaded before the "
                    "script's own code (through a sitecustomize on PYTHONPATH, which chains "
                    "to any of the job's own; the script is not changed), then attach to "
                    "it as `attach` does. Exits with the command's exit code."),
        epilog="examples:\n"
               "  dlprof-agent run -- python train.py --epochs 3\n"
               "  dlprof-agent run --layers --port 9946 -- python train.py\n\n"
               + EXIT_CODES_HELP)
    run.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                     help="the training command, after --")
    _add_serving_options(run, duration_default=None)
    _add_sampling_options(run)
    _add_probe_options(run, injects=False)

    snapshot = commands.add_parser(
        "snapshot", help="print the metrics of a process once and exit",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_para("Take one sample of PID and print it in the Prometheus text format, "
                    "for scripts and quick checks. Counters are totals since the process "
                    "started; rates need two snapshots or a Prometheus server."),
        epilog="examples:\n"
               "  dlprof-agent snapshot 4242\n"
               "  dlprof-agent snapshot 4242 | grep dlprof_thread_group\n"
               "  dlprof-agent snapshot 4242 | promtool check metrics\n\n"
               + EXIT_CODES_HELP)
    snapshot.add_argument("pid", type=pid, metavar="PID", help="the process id")
    _add_sampling_options(snapshot)

    demo = commands.add_parser(
        "demo", help="start a demo training job, attach to it, and show what the agent sees",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_para("Start a small PyTorch training job (a CNN on synthetic data; without "
                    "torch, a synthetic busy process with named threads and a child), attach "
                    "to it as `attach` would, injecting the probe with layer timing, and "
                    "after --duration print the summary and some of the series a Prometheus "
                    "scrape gets."),
        epilog="examples:\n"
               "  dlprof-agent demo\n"
               "  dlprof-agent demo --duration 60 --threads 8   (then scrape "
               f"http://{DEFAULT_LISTEN}:{DEFAULT_PORT}/metrics)\n\n" + EXIT_CODES_HELP)
    demo.add_argument("--threads", type=int, default=3,
                      help="the job's threads: PyTorch intra-op threads (at most the CPU "
                           "count), or busy worker threads (default 3)")
    _add_serving_options(demo, duration_default=10.0)
    _add_sampling_options(demo)
    daemon = commands.add_parser(
        "daemon", help="watch this node: attach to every GPU job and every job with the probe",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_para("One agent per node, for a Kubernetes DaemonSet, a systemd unit or a "
                    "SLURM prolog. Every --scan-interval seconds it looks for jobs: processes "
                    "with a context on a GPU (through NVML), processes that loaded the "
                    "in-process probe (dlprof-agent run, or dlprof_agent.probe.enable()), "
                    "and processes whose command line matches --match. It reads each as "
                    "`attach` does, with the probe where it can, serves them all on one "
                    "/metrics (each process under its own pid label), and drops each job "
                    "when it exits: its series are gone from the next scrape."),
        epilog="examples:\n"
               "  dlprof-agent daemon --listen 0.0.0.0\n"
               "  dlprof-agent daemon --match 'python .*train' --layers\n"
               "  dlprof-agent daemon --env SLURM_JOB_ID=$SLURM_JOB_ID --match python "
               "--port 9951\n\n"
               "Reading other users' processes needs root, or CAP_SYS_PTRACE (and\n"
               "CAP_DAC_OVERRIDE to reach their probe sockets); see docs/deploy.md for\n"
               "Kubernetes, systemd and SLURM.\n\n"
               + EXIT_CODES_HELP)
    _add_serving_options(daemon, duration_default=None, one_target=False)
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
    _add_probe_options(daemon, injects=True)
    trace_cli.add_parser(commands, pid)
    workload_cli.add_parser(commands, OneLineErrorParser)
    grafana_cli.add_parser(commands, OneLineErrorParser)
    return parser


def _probe_options(args: argparse.Namespace) -> ProbeOptions | None:
    """The probe a command asked for; None for --no-probe (`run` always has one)."""
    if not getattr(args, "probe", args.command == "run"):
        return None
    return ProbeOptions(inject=getattr(args, "inject", False), layers=args.layers,
                        warmup_steps=args.warmup_steps, kernels=args.kernels,
                        layers_budget=args.layers_budget, layers_every=args.layers_every or 0)


def daemon_command(args: argparse.Namespace) -> int:
    from dlprof_agent.agent.daemon import DaemonOptions, serve_node

    configure_logging(None)
    if args.quiet:
        log.setLevel(logging.WARNING)
    web = load_web_config(args.web_config_file)
    options = DaemonOptions(interval=args.interval, scan_interval=args.scan_interval,
                            matches=tuple(args.match), environment=tuple(args.env),
                            probe=_probe_options(args), gpu=args.gpu, grace=args.grace)
    return serve_node(options, args.listen, args.port, web)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "workload":
        return workload_cli.workload_command(args, sys.stdout)
    if args.command == "grafana":
        return grafana_cli.grafana_command(args, sys.stdout)
    if args.command == "snapshot":
        return snapshot_command(args.pid, children=args.children, gpu=args.gpu,
                                out=sys.stdout)
    if args.command == "daemon":
        return daemon_command(args)
    if args.command == "trace":
        return trace_cli.trace_command(args, sys.stdout, sys.stderr)
    options = ServeOptions(listen=args.listen, port=args.port, interval=args.interval,
                           duration=args.duration, grace=args.grace, quiet=args.quiet,
                           children=args.children, gpu=args.gpu, probe=_probe_options(args),
                           web_config=load_web_config(args.web_config_file))
    if args.command == "run":
        return run_command(args.command_line, options)
    if args.command == "demo":
        return demo_command(args, options, sys.stdout)
    return serve(args.pid, options)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return ExitCode.USAGE
    try:
        return _dispatch(args)
    except DlprofError as error:
        print(f"dlprof-agent: error: {error.one_line()}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `dlprof-agent snapshot PID | head`: the reader left; that is not a failure.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ExitCode.FINISHED
