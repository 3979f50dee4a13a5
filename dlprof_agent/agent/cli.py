"""The ``dlprof-agent`` command line."""

from __future__ import annotations

import argparse
import errno
import importlib.util
import ipaddress
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any, TextIO

import psutil
from prometheus_client import CollectorRegistry, generate_latest

from dlprof_agent import __version__
from dlprof_agent.agent import grafana_cli, trace_cli, workload_cli
from dlprof_agent.agent.arguments import budget_fraction, seconds, whole_number
from dlprof_agent.agent.arguments import paragraph as _para
from dlprof_agent.agent.findings import FindingsTracker
from dlprof_agent.agent.reach.channel import ProbeSource, open_probe
from dlprof_agent.agent.reach.connect import ProbeOptions
from dlprof_agent.agent.reach.target import open_target
from dlprof_agent.agent.sampler import Sampler, Snapshot
from dlprof_agent.agent.status import LiveStatus, StatusAwareHandler, Summary
from dlprof_agent.collectors.error_log import ErrorLog
from dlprof_agent.collectors.gpu import GpuCollector
from dlprof_agent.collectors.host import HostCollector
from dlprof_agent.collectors.limits import LimitsCollector
from dlprof_agent.collectors.process import ProcessCollector
from dlprof_agent.errors import (
    EXIT_CODES_HELP,
    DlprofError,
    MissingLibrary,
    PortUnavailable,
    TargetNotFound,
    UsageError,
    WebConfigError,
)
from dlprof_agent.exporters.http import MetricsServer
from dlprof_agent.exporters.prometheus import SnapshotCollector
from dlprof_agent.exporters.web_config import WebConfig
from dlprof_agent.exporters.web_config import load as read_web_config

DEFAULT_PORT = 9945  # clear of node_exporter 9100, process-exporter 9256, dcgm-exporter 9400
DEFAULT_LISTEN = "127.0.0.1"
DEFAULT_INTERVAL_SECONDS = 1.0
DEFAULT_GRACE_SECONDS = 15.0  # one scrape at Prometheus's usual 15 s interval
DEFAULT_WARMUP_STEPS = 10
# `run`: how long the started command has to load its probe (Python's start-up and
# the script's first imports) before it is measured from outside only.
RUN_PROBE_WAIT_SECONDS = 10.0
MIN_INTERVAL_SECONDS = 0.05

log = logging.getLogger("dlprof_agent")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a port: use 1-65535, or 0 for any")
    return value


def _pid(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a pid: give the number `ps` or `pgrep -f train.py` shows"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a pid: pids are positive")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors in one line, like the rest of the agent."""

    def error(self, message: str) -> Any:
        self.exit(2, f"dlprof-agent: error: {message} (see {self.prog} --help)\n")


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
    parser.add_argument("--port", type=_port, default=DEFAULT_PORT,
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
    parser = _Parser(
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
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

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
    attach.add_argument("pid", type=_pid, metavar="PID", help="the training job's process id")
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
    snapshot.add_argument("pid", type=_pid, metavar="PID", help="the process id")
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
    daemon.add_argument("--match", action="append", type=_regex, default=[], metavar="REGEX",
                        help="also watch processes whose command line matches (repeatable), "
                             "e.g. 'python .*train'")
    daemon.add_argument("--env", action="append", type=_environment_pair, default=[],
                        metavar="NAME=VALUE",
                        help="watch only processes whose environment has NAME=VALUE "
                             "(repeatable), e.g. SLURM_JOB_ID=1234")
    daemon.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=True,
                        help="read GPUs and find GPU jobs through NVML (default: on)")
    _add_probe_options(daemon, injects=True)
    trace_cli.add_parser(commands, _pid)
    workload_cli.add_parser(commands, _Parser)
    grafana_cli.add_parser(commands, _Parser)
    return parser


def _regex(text: str) -> re.Pattern[str]:
    try:
        return re.compile(text)
    except re.error as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression: {error}"
                                         ) from None


def _environment_pair(text: str) -> tuple[str, str]:
    name, equals, value = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE, e.g. SLURM_JOB_ID=1234")
    return name, value


@dataclass(frozen=True)
class ServeOptions:
    listen: str
    port: int
    interval: float
    duration: float | None
    grace: float
    quiet: bool
    children: bool
    gpu: bool
    probe: ProbeOptions | None = None  # None: never talk to the process
    probe_wait_seconds: float = 0.0  # `run`: the probe appears once Python has started
    web_config: WebConfig | None = None  # --web.config.file, loaded


def _make_sampler(pid: int, *, interval: float, children: bool, gpu: bool) -> Sampler:
    errors = ErrorLog(("process", "host", *(("gpu",) if gpu else ())))
    gpu_collector = None
    if gpu:
        gpu_collector = GpuCollector(errors=errors)
    try:
        processes = ProcessCollector(pid, children=children, errors=errors)
    except psutil.NoSuchProcess as error:  # gone since open_target checked it
        raise TargetNotFound(f"process {pid} exited while the agent was starting",
                             "attach to a running job") from error
    return Sampler(target_pid=pid, processes=processes, host=HostCollector(),
                   gpu=gpu_collector, errors=errors, interval_seconds=interval,
                   limits=LimitsCollector(pid), findings=FindingsTracker())


def _first_sample(sampler: Sampler) -> Snapshot:
    snapshot = sampler.sample_once()
    if not snapshot.target_up:
        raise TargetNotFound(f"process {sampler.target_pid} exited while the agent was "
                             "starting", "attach to a running job")
    return snapshot


def _registry(sampler: Sampler) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: sampler.latest,
                                        interval_seconds=sampler.interval_seconds))
    return registry


def _start_server(sampler: Sampler, options: ServeOptions) -> MetricsServer:
    def health() -> tuple[bool, dict[str, Any]]:
        latest = sampler.latest
        age = None if latest is None else time.monotonic() - latest.monotonic_seconds
        healthy = age is not None and age < 3 * sampler.interval_seconds + 1
        return healthy, {"target_pid": sampler.target_pid,
                         "target_up": bool(latest and latest.target_up),
                         "last_sample_age_seconds": age}

    return _listen(_registry(sampler), health, options.listen, options.port,
                   version=lambda: sampler.latest, web_config=options.web_config)


def load_web_config(path: str | None) -> WebConfig | None:
    """--web.config.file, read and checked before anything starts."""
    if path is None:
        return None
    try:
        return read_web_config(path)
    except MissingLibrary as error:
        raise UsageError(f"--web.config.file: {error}") from None
    except WebConfigError as error:
        raise UsageError(f"--web.config.file: {error}",
                         "see \"Locking /metrics\" in docs/deploy.md") from None


def _loopback(listen: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(listen, None))
    except (OSError, ValueError):
        return False


def _listen(registry: CollectorRegistry, health: Callable[[], tuple[bool, dict[str, Any]]],
            listen: str, port: int, *, version: Callable[[], object] | None = None,
            web_config: WebConfig | None = None) -> MetricsServer:
    """A started /metrics server, or a one-line error saying why there is none.
    ``version``: the published sample; a scrape renders each one at most once."""
    try:
        server = MetricsServer(registry, host=listen, port=port, health=health,
                               version=version, web_config=web_config)
    except socket.gaierror:
        raise UsageError(f"cannot listen on {listen!r}: not an address of this "
                         "machine", "use e.g. --listen 127.0.0.1 or --listen 0.0.0.0") from None
    except OSError as error:
        where = f"{listen}:{port}"
        if error.errno == errno.EADDRINUSE:
            raise PortUnavailable(f"port {port} on {listen} is already in use",
                                  f"pick another with --port, e.g. --port {port + 1}"
                                  ) from None
        if error.errno == errno.EACCES:
            raise PortUnavailable(f"no permission to listen on {where}",
                                  "ports below 1024 need root; use e.g. --port "
                                  f"{DEFAULT_PORT}") from None
        raise UsageError(f"cannot listen on {where}: {error.strerror}",
                         "check --listen and --port") from None
    if web_config is None and not _loopback(listen):
        log.warning("serving /metrics on %s without TLS or authentication: anyone who can "
                    "reach this port reads it (see --web.config.file)", listen)
    server.start()
    return server


def _configure_logging(status: LiveStatus | None) -> None:
    handler = StatusAwareHandler(sys.stderr, status)
    handler.setFormatter(logging.Formatter("dlprof-agent: %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


class _Stop(BaseException):
    """SIGTERM. A BaseException, as KeyboardInterrupt is: a collector read guarded
    by ``except Exception`` that it lands in must not swallow it."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def _linger(server: MetricsServer, grace: float, exited: str) -> None:
    """After the target's exit, serve dlprof_target_up 0 for ``grace`` seconds so that
    Prometheus's next scrape sees the end; but only if anything scraped at all."""
    if grace <= 0:
        log.info("%s", exited)
    elif server.scrapes == 0:
        log.info("%s; nothing has scraped /metrics, so the agent stops now", exited)
    else:
        log.info("%s; serving dlprof_target_up 0 for %g s more, so that the next scrape "
                 "sees it (Ctrl-C stops now; --grace sets how long)", exited, grace)
        time.sleep(grace)


def serve(pid: int, options: ServeOptions, *, out: TextIO = sys.stdout,
          before_stop: Callable[[int], None] | None = None,
          on_summary: Callable[[dict[str, Any]], None] | None = None,
          describe_exit: Callable[[], str] | None = None) -> int:
    """Attach to ``pid``, serve until the duration, Ctrl-C, SIGTERM or the target's
    exit, then print the summary. Returns the exit code.

    ``before_stop`` gets the port while the endpoint still serves, at the end;
    ``on_summary`` gets the summary as a dict (`Summary.as_dict`), even when quiet;
    ``describe_exit`` says how the target ended (`run`: with its exit code)."""
    open_target(pid)
    status = LiveStatus(out) if out.isatty() and not options.quiet else None
    _configure_logging(status)
    sampler = _make_sampler(pid, interval=options.interval, children=options.children,
                            gpu=options.gpu)
    server = _start_server(sampler, options)
    summary = Summary()
    probe_source: ProbeSource | None = None
    try:
        if options.probe is not None:
            probe_source = sampler.probe = open_probe(
                pid, options.probe, interval=options.interval,
                wait_seconds=options.probe_wait_seconds)
            if (client := probe_source.client) is not None:
                log.info("probe active in pid %d (%s)", pid,
                         ", ".join(client.hello.get("frameworks", [])) or
                         "no framework imported yet")
        first = _first_sample(sampler)
        summary.add(first)
        log.info("attached to pid %d (%s); serving http://%s:%d/metrics", pid,
                 first.target.name if first.target else "?", options.listen, server.port)

        stop = threading.Event()

        def on_sample(snapshot: Snapshot) -> None:
            summary.add(snapshot)
            if status is not None:
                status.show(snapshot)

        failures: list[BaseException] = []

        def sample_until_stopped() -> None:
            # Not niced, unlike the render and serving threads: a niced reader of the
            # job's thread states runs mostly while the job's threads sleep, which
            # biases every instantaneous reading (runnable threads) low.
            try:
                sampler.run(stop, on_sample)
            except BaseException as error:  # a bug: re-raised below, with its traceback
                failures.append(error)

        loop = threading.Thread(target=sample_until_stopped, name="dlprof-sampler",
                                daemon=True)
        previous_term = signal.signal(signal.SIGTERM, _raise_stop)
        try:
            loop.start()
            deadline = None if options.duration is None else time.monotonic() + options.duration
            while loop.is_alive():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                loop.join(0.2 if remaining is None else min(0.2, remaining))
            stop.set()
            loop.join()
            if failures:
                raise failures[0]
            exited = not sampler.latest or not sampler.latest.target_up
            if exited:
                if status is not None:
                    status.clear()
                _linger(server, options.grace,
                        describe_exit() if describe_exit else f"process {pid} exited")
        except (KeyboardInterrupt, _Stop):
            stop.set()
        finally:
            signal.signal(signal.SIGTERM, previous_term)
        if before_stop is not None:
            before_stop(server.port)
    finally:
        if probe_source is not None:
            probe_source.stop()  # the probe removes its hooks: the job is as it was
        server.stop()
    if status is not None:
        status.clear()
    if on_summary is not None:
        on_summary(summary.as_dict(pid))
    if not options.quiet:
        latest = sampler.latest
        print(summary.render(pid, target_exited=bool(latest and not latest.target_up)),
              file=out)
    return 0


def snapshot_command(pid: int, *, children: bool, gpu: bool, out: TextIO) -> int:
    open_target(pid)
    _configure_logging(None)
    sampler = _make_sampler(pid, interval=DEFAULT_INTERVAL_SECONDS, children=children, gpu=gpu)
    _first_sample(sampler)
    out.write(generate_latest(_registry(sampler)).decode())
    out.flush()
    return 0


DEMO_SERIES = ("dlprof_target_up", "dlprof_process_cpu_seconds_total",
               "dlprof_process_threads", "dlprof_thread_group_threads",
               "dlprof_process_resident_memory_peak_bytes", "dlprof_gpu_available",
               "dlprof_probe_up", "dlprof_steps_total", "dlprof_samples_total",
               "dlprof_step_duration_seconds_sum", "dlprof_step_duration_seconds_count",
               "dlprof_step_phase_seconds_total", "dlprof_framework_info")


def _cuda_available() -> bool:
    """Asked in a child: importing torch here would cost the agent a second of start-up
    and hundreds of MiB for the rest of the demo."""
    check = subprocess.run([sys.executable, "-c",
                            "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"],
                           capture_output=True, timeout=60, check=False)
    return check.returncode == 0


def _start_demo_workload(args: argparse.Namespace, seconds: float, out: TextIO
                         ) -> tuple[subprocess.Popen[bytes], bool]:
    """A PyTorch training job when torch is installed, else a busy process."""
    if importlib.util.find_spec("torch") is not None:
        # On a GPU when the machine has one: NVML and the probe then both have work to see.
        device = "cuda" if _cuda_available() else "cpu"
        print(f"demo: starting a PyTorch job (a small CNN on synthetic data, on {device})...",
              file=out, flush=True)
        job = subprocess.Popen(
            [sys.executable, "-m", "dlprof_agent.workloads.torch_train", "--seconds",
             str(seconds), "--threads", str(min(args.threads, os.cpu_count() or 1)),
             "--device", device, "--batch", "256" if device == "cuda" else "32"],
            stdout=subprocess.PIPE)
        assert job.stdout is not None
        job.stdout.readline()  # "training", or nothing if it failed
        if job.poll() is None:
            print(f"demo: pid {job.pid} is training; attaching and injecting the probe, with "
                  "layer timing", file=out)
            return job, True
        log.info("the PyTorch demo job did not start; using a busy process instead")
    workload = subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent.workloads.busy", "--threads", str(args.threads),
         "--children", "1", "--seconds", str(seconds)], stdout=subprocess.DEVNULL)
    time.sleep(0.5)  # let the workload start its threads and child
    print(f"demo: started a busy process, pid {workload.pid}, with {args.threads} "
          "worker threads and one child", file=out)
    return workload, False


def demo_command(args: argparse.Namespace, options: ServeOptions, out: TextIO) -> int:
    workload, trains = _start_demo_workload(args, (options.duration or 10) + 30, out)
    if trains:
        options = replace(options, probe=ProbeOptions(layers=True,
                                                      warmup_steps=DEFAULT_WARMUP_STEPS))
    exposition: list[str] = []

    def fetch_metrics(port: int) -> None:
        # Read from the live endpoint, as Prometheus would see it.
        host = f"[{options.listen}]" if ":" in options.listen else options.listen
        url = f"http://{host}:{port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                exposition.append(response.read().decode())
        except OSError as error:
            log.info("could not read the demo's own endpoint: %s", error)

    try:
        print(f"demo: watching for {options.duration:g} s", file=out)
        try:
            code = serve(workload.pid, options, out=out, before_stop=fetch_metrics)
        except PortUnavailable:
            log.info("port %d is in use; the demo takes a free one instead", options.port)
            options = replace(options, port=0)
            code = serve(workload.pid, options, out=out, before_stop=fetch_metrics)
    finally:
        workload.terminate()
        workload.wait(5)
    if exposition:
        print("\nwhat Prometheus scrapes (a few of the series):", file=out)
        for line in _demo_lines(exposition[0]):
            print("  " + line, file=out)
    return code


def _demo_lines(exposition: str) -> list[str]:
    return [line for line in exposition.splitlines()
            if line.startswith(DEMO_SERIES)][:32]


def run_command(command_line: list[str], options: ServeOptions, *,
                stdout: TextIO | None = None,
                on_summary: Callable[[dict[str, Any]], None] | None = None) -> int:
    """``stdout``: where the command's output goes (default: the agent's own)."""
    if command_line and command_line[0] == "--":
        command_line = command_line[1:]
    if not command_line:
        raise UsageError("no command to run", "put it after --, e.g. "
                         "dlprof-agent run -- python train.py")
    from dlprof_agent.probe.bootstrap import preload_environment

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
    return 128 - code if code < 0 else code


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
    from dlprof_agent.collectors.probe import find_probe_socket

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


def daemon_command(args: argparse.Namespace) -> int:
    from dlprof_agent.agent.daemon import DaemonOptions, serve_node

    _configure_logging(None)
    if args.quiet:
        log.setLevel(logging.WARNING)
    web = load_web_config(args.web_config_file)
    probe = (ProbeOptions(inject=args.inject, layers=args.layers,
                          warmup_steps=args.warmup_steps, kernels=args.kernels,
                          layers_budget=args.layers_budget, layers_every=args.layers_every or 0)
             if args.probe else None)
    options = DaemonOptions(interval=args.interval, scan_interval=args.scan_interval,
                            matches=tuple(args.match), environment=tuple(args.env),
                            probe=probe, gpu=args.gpu)

    def start(registry: CollectorRegistry, health: Callable[[], tuple[bool, dict[str, Any]]],
              version: Callable[[], object]) -> MetricsServer:
        return _listen(registry, health, args.listen, args.port, version=version,
                       web_config=web)
    return serve_node(options, args.listen, start)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
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
        probe = None
        if getattr(args, "probe", args.command == "run"):
            probe = ProbeOptions(inject=getattr(args, "inject", False), layers=args.layers,
                                 warmup_steps=args.warmup_steps, kernels=args.kernels,
                                 layers_budget=args.layers_budget,
                                 layers_every=args.layers_every or 0)
        options = ServeOptions(listen=args.listen, port=args.port, interval=args.interval,
                               duration=args.duration, grace=args.grace, quiet=args.quiet,
                               children=args.children, gpu=args.gpu, probe=probe,
                               web_config=load_web_config(args.web_config_file))
        if args.command == "run":
            return run_command(args.command_line, options)
        if args.command == "demo":
            return demo_command(args, options, sys.stdout)
        return serve(args.pid, options)
    except DlprofError as error:
        print(f"dlprof-agent: error: {error.one_line()}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `dlprof-agent snapshot PID | head`: the reader left; that is not a failure.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
