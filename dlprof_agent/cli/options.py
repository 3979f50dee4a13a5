"""The options that several commands share (what to sample, the probe, where to
serve), and the agent's options built from them."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping

from dlprof_agent.agent.core import DEFAULT_INTERVAL_SECONDS
from dlprof_agent.agent.endpoint import DEFAULT_LISTEN, DEFAULT_PORT, load_web_config
from dlprof_agent.agent.exit_totals import DEFAULT_GRACE_SECONDS
from dlprof_agent.agent.serve import MIN_INTERVAL_SECONDS, ServeOptions
from dlprof_agent.cli.arguments import budget_fraction, node_name, port, seconds, whole_number
from dlprof_agent.collectors.labels import MAX_LABEL_CHARS
from dlprof_agent.exporters.admission import MAX_REQUESTS
from dlprof_agent.probe.messages import DEFAULT_WARMUP_STEPS
from dlprof_agent.probe_link.connect import ProbeOptions
from dlprof_agent.probe_link.series_budget import DEFAULT_TARGET_SERIES


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--children", action=argparse.BooleanOptionalAction, default=True,
                        help="also read the target's descendants (launcher ranks, data-loader "
                             "workers), each as its own pid (default: on)")
    parser.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=True,
                        help="read GPUs through NVML when a driver is present (default: on)")


def add_probe_options(parser: argparse.ArgumentParser, *, injects: bool) -> None:
    group = parser.add_argument_group(
        "in-process probe", "step time, samples per second, per-layer time and framework "
        "settings, measured inside the job")
    group.add_argument("--no-split", dest="split", action="store_false",
                       help="do not split each step into forward, backward, optimizer, "
                            "exchange (waiting for other ranks) and other; the split is on by "
                            "default, a few hooks a step, and the fleet's straggler rules "
                            "need it")
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


def add_serving_options(parser: argparse.ArgumentParser, *, duration_default: float | None,
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
    parser.add_argument("--web.max-requests", dest="max_requests", metavar="N",
                        type=whole_number(0, unit="requests"), default=MAX_REQUESTS,
                        help="requests served at once; more get 503 at once, as with "
                             f"node_exporter (default {MAX_REQUESTS}; 0: no bound)")
    parser.add_argument("--interval", type=seconds(MIN_INTERVAL_SECONDS),
                        default=DEFAULT_INTERVAL_SECONDS, metavar="SECONDS",
                        help="time between samples (default 1). Scrapes read the latest "
                             "sample and never trigger one")
    parser.add_argument("--max-series-per-target", type=whole_number(100, unit="series"),
                        default=DEFAULT_TARGET_SERIES, metavar="N",
                        help="series one job may add (default "
                             f"{DEFAULT_TARGET_SERIES:,}); past it its layers and kernels "
                             "beyond the top ones by time fold into one 'other' row per "
                             "family, counted in dlprof_agent_series_dropped_total and "
                             "reported by the series_capped finding. Layer and kernel names "
                             f"are cut to {MAX_LABEL_CHARS} characters (with a hash of the "
                             "whole name)")
    parser.add_argument("--node-name", type=node_name, metavar="NAME",
                        help="the node label on dlprof_target_info, which says where each "
                             "rank runs (pids repeat across nodes). Default: $NODE_NAME "
                             "(the DaemonSet sets it from spec.nodeName), then "
                             "$SLURMD_NODENAME (SLURM's name for the node), then this "
                             "host's name. Give the name your other exporters use, so "
                             "that the series join")
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


NODE_NAME_VARIABLES = ("NODE_NAME", "SLURMD_NODENAME")


def resolved_node_name(given: str | None, environment: Mapping[str, str] = os.environ
                       ) -> str:
    """--node-name, else the first of NODE_NAME_VARIABLES set, else the hostname."""
    if given:
        return given
    for name in NODE_NAME_VARIABLES:
        value = environment.get(name, "").strip()
        if value:
            return value
    return socket.gethostname()


def probe_options(args: argparse.Namespace) -> ProbeOptions | None:
    """The probe a command asked for; None for --no-probe. A command without
    --no-inject (`run`) uses only a probe the job started."""
    if not getattr(args, "probe", True):
        return None
    return ProbeOptions(inject=getattr(args, "inject", False), layers=args.layers,
                        split=args.split,
                        warmup_steps=args.warmup_steps, kernels=args.kernels,
                        layers_budget=args.layers_budget, layers_every=args.layers_every or 0,
                        max_series=getattr(args, "max_series_per_target", None))


def serve_options(args: argparse.Namespace, probe: ProbeOptions | None) -> ServeOptions:
    """How a one-target command (attach, run, demo) samples and serves."""
    return ServeOptions(listen=args.listen, port=args.port, interval=args.interval,
                        duration=args.duration, grace=args.grace, quiet=args.quiet,
                        children=args.children, gpu=args.gpu, probe=probe,
                        web_config=load_web_config(args.web_config_file),
                        max_series_per_target=args.max_series_per_target,
                        max_requests=args.max_requests,
                        node_name=resolved_node_name(args.node_name))
