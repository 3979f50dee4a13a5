"""`dlprof-agent top PID`: attach as `attach` does and show where the job's time
goes on one live screen; `top --url URL`: the same screen from any running
agent's or daemon's /metrics."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlprof_agent.agent.core import Agent
from dlprof_agent.agent.serve import serve
from dlprof_agent.cli.arguments import paragraph, pid
from dlprof_agent.cli.options import (
    add_probe_options,
    add_sampling_options,
    add_serving_options,
    probe_options,
    serve_options,
)
from dlprof_agent.errors import EXIT_CODES_HELP, UsageError
from dlprof_agent.exporters.metrics_reader import MetricsUrl, collected
from dlprof_agent.exporters.prometheus import NodeCollector

if TYPE_CHECKING:  # Rich is imported when top runs, not by every command's parser
    from dlprof_agent.agent.top_screen import TopScreen

PASSWORD_VARIABLE = "DLPROF_PASSWORD"


def add_parser(commands: Any) -> None:
    top = commands.add_parser(
        "top", help="attach and show where a job's time goes on one live screen",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=paragraph(
            "Attach to the process PID as `attach` does (same options; /metrics is "
            "served too unless --no-serve) and show, refreshed every --interval: steps "
            "per second, step time and samples per second with their recent history; "
            "the step split into forward, backward, optimizer, exchange and other; the "
            "top layers (--layers, or press l); the top GPU kernels and copies; CPU by "
            "mode, threads by name, resident memory and its peak; each GPU's "
            "utilization, memory, power and clock; and the findings now raised, with "
            "what to try. The screen is drawn by the agent, never in the job.")
        + "\n\n" + paragraph(
            "With --url it reads another agent's or a daemon's /metrics instead and "
            "attaches to nothing: a daemon's targets come first as a table (arrows "
            "choose, Enter opens one, t comes back), or give its PID after the URL.")
        + "\n\nkeys:\n"
          "  q  quit, with the summary attach prints (Ctrl-C too)\n"
          "  l  layer timing on or off in the job\n"
          "  s  sort layers, kernels and threads by time or by name\n"
          "  ?  help\n\n"
          "Off a terminal, top says so and behaves as attach (with --url: prints the "
          "screen once).",
        epilog="examples:\n"
               "  dlprof-agent top $(pgrep -f train.py)\n"
               "  dlprof-agent top 4242 --layers --no-serve\n"
               "  dlprof-agent top --url http://node7:9945             a daemon's jobs\n"
               "  dlprof-agent top --url http://node7:9945 4242        one of them\n"
               "  DLPROF_PASSWORD=... dlprof-agent top --url https://node7:9945 \\\n"
               "      --user admin --ca-file ca.pem                    basic auth and TLS\n\n"
               + EXIT_CODES_HELP)
    top.add_argument("pid", type=pid, metavar="PID", nargs="?",
                     help="the training job's process id (with --url: which of the "
                          "daemon's targets to open)")
    top.add_argument("--no-serve", dest="serve_metrics", action="store_false",
                     help="do not serve /metrics: the screen alone")
    remote = top.add_argument_group(
        "another agent's metrics", "read a running agent or daemon instead of attaching")
    remote.add_argument("--url", metavar="URL",
                        help="its address, http(s)://NODE:9945 (/metrics is added)")
    remote.add_argument("--user", metavar="NAME",
                        help=f"basic auth user (--web.config.file's basic_auth_users); the "
                             f"password comes from ${PASSWORD_VARIABLE} or --password-file")
    remote.add_argument("--password-file", metavar="FILE", type=Path,
                        help="a file holding the password, on its first line")
    remote.add_argument("--ca-file", metavar="FILE",
                        help="the CA that signed the agent's TLS certificate")
    remote.add_argument("--insecure", action="store_true",
                        help="take any TLS certificate (a self-signed one on a test node)")
    add_serving_options(top, duration_default=None)
    add_sampling_options(top)
    add_probe_options(top, injects=True)


def _password(args: argparse.Namespace) -> str | None:
    if args.password_file is not None:
        try:
            return args.password_file.read_text().splitlines()[0] \
                if args.password_file.stat().st_size else ""
        except OSError as error:
            raise UsageError(f"cannot read --password-file {args.password_file} "
                             f"({error.strerror})") from None
    return os.environ.get(PASSWORD_VARIABLE)


def run(args: argparse.Namespace) -> int:
    if args.url is not None:
        if not args.url.startswith(("http://", "https://")):
            raise UsageError(f"--url {args.url!r} is not an http:// or https:// address",
                             "for example --url http://node7:9945")
        source = MetricsUrl(args.url, user=args.user,
                            password=_password(args) if args.user is not None else None,
                            ca_file=args.ca_file, insecure=args.insecure)
        from dlprof_agent.agent.top_remote import watch_url

        return watch_url(source, pid=args.pid, interval=args.interval)
    if args.pid is None:
        raise UsageError("top needs a PID, or --url", "dlprof-agent top $(pgrep -f train.py)")
    options = replace(serve_options(args, probe_options(args)), serve_metrics=args.serve_metrics)
    if not (sys.stdout.isatty() and sys.stdin.isatty()) or options.quiet:
        print("dlprof-agent: top: not a terminal; behaving as attach", file=sys.stderr)
        return serve(args.pid, options)
    return serve(args.pid, options, screen=lambda agent: _screen(agent, args.pid))


def _screen(agent: Agent, pid: int) -> TopScreen:
    """The screen of ``pid``, reading the agent's latest pass as a scrape would."""
    from dlprof_agent.agent.top_screen import TopScreen

    collector = NodeCollector(lambda: agent.latest, interval_seconds=agent.options.interval)
    layers = [agent.options.probe is not None and agent.options.probe.layers]

    def toggle_layers() -> str:
        watch = agent.targets.get(pid)
        probe = None if watch is None else watch.probe
        if probe is None:
            return "no probe in the job (yet): no layer timing"
        layers[0] = not layers[0]
        probe.set_layers(layers[0])
        return f"layer timing {'on' if layers[0] else 'off'} from the next pass"

    return TopScreen(pid, lambda: collected(collector) if agent.latest else None,
                     keys={"l": toggle_layers})
