"""`dlprof-agent grafana provision`: its options, checked, and its output; the
talking to Grafana's HTTP API is grafana/provision.py's."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, TextIO
from urllib.parse import urlsplit

from dlprof_agent.cli.arguments import OneLineErrorParser, paragraph, seconds
from dlprof_agent.errors import ExitCode, UsageError, exit_codes_help
from dlprof_agent.grafana.provision import (
    DATASOURCE_UID,
    Credential,
    GrafanaSession,
    GrafanaUrl,
    provision,
    shipped_dashboards,
)

DEFAULT_DATASOURCE_NAME = "dlprof-prometheus"
DEFAULT_FOLDER = "dlprof-agent"
DEFAULT_PROMETHEUS_URL = "http://localhost:9090"
DEFAULT_TIMEOUT_SECONDS = 10.0
TOKEN_ENV = "GRAFANA_TOKEN"

EXIT_CODES = exit_codes_help(
    (ExitCode.FINISHED, ExitCode.USAGE, ExitCode.GRAFANA),
    {ExitCode.FINISHED: "done",
     ExitCode.USAGE: "bad arguments, or grafana-client is not installed",
     ExitCode.GRAFANA: "cannot reach Grafana, or it refused the credentials or a change"})


def add_parser(commands: Any,
               parser_class: type[argparse.ArgumentParser] = OneLineErrorParser
               ) -> None:
    grafana = commands.add_parser(
        "grafana", help="put the shipped dashboards into a running Grafana",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=paragraph("Set up Grafana for the agent's metrics: the Prometheus data "
                          "source and the shipped dashboards."),
        epilog="examples:\n"
               "  dlprof-agent grafana provision --url http://localhost:3000 --user admin "
               "--password admin\n")
    actions = grafana.add_subparsers(dest="grafana_command", metavar="ACTION",
                                     parser_class=parser_class)
    provisioning = actions.add_parser(
        "provision", help="create the data source and folder, and upload every dashboard",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=paragraph(
            "Through Grafana's HTTP API: create or update a Prometheus data source (uid "
            f"{DATASOURCE_UID}) pointing at --prometheus-url, make sure the folder --folder "
            "exists, and upload every dashboard the agent ships into it, overwriting the "
            "earlier upload (the dashboards keep their own uids, so links stay valid). "
            "Each dashboard's data source variable defaults to that data source. Running "
            "it again gives the same result and no duplicates.") + "\n\n" + paragraph(
            "Credentials: a service account token (Administration > Users and access > "
            "Service accounts; the Admin role, since it creates a data source) with "
            f"--token or ${TOKEN_ENV}, or a user's --user and --password (basic auth).")
            + "\n\n" + paragraph(
            "Without the API, Grafana can load the same from files at start-up: see "
            "grafana/provisioning/ in the source tree."),
        epilog="examples:\n"
               "  dlprof-agent grafana provision --url http://localhost:3000 --user admin "
               "--password admin\n"
               f"  {TOKEN_ENV}=glsa_... dlprof-agent grafana provision "
               "--url https://grafana.example.com\n"
               "  dlprof-agent grafana provision --url http://grafana:3000/grafana "
               "--token \"$TOKEN\" \\\n"
               "      --prometheus-url http://prometheus:9090 --folder 'Training jobs'\n\n"
               "--prometheus-url is the address Grafana's server uses, not your browser: "
               "inside Docker\nit is e.g. http://prometheus:9090 or "
               "http://host.docker.internal:9090.\n\n" + EXIT_CODES)
    provisioning.add_argument("--url", required=True, metavar="URL",
                           help="Grafana's address, with any sub-path it is served under "
                                "(e.g. http://localhost:3000)")
    credentials = provisioning.add_argument_group(
        "credentials", f"--token, or --user and --password (default: ${TOKEN_ENV})")
    credentials.add_argument("--token", metavar="TOKEN",
                             help="a service account token with the Admin role (sent as a "
                                  f"Bearer token); ${TOKEN_ENV} keeps it out of `ps`")
    credentials.add_argument("--user", metavar="USER", help="a Grafana user, for basic auth")
    credentials.add_argument("--password", metavar="PASSWORD", help="that user's password")
    provisioning.add_argument("--folder", default=DEFAULT_FOLDER, metavar="TITLE",
                           help=f"the folder for the dashboards (default {DEFAULT_FOLDER}); "
                                "an existing folder of that title is used")
    provisioning.add_argument("--prometheus-url", default=DEFAULT_PROMETHEUS_URL, metavar="URL",
                           help="the Prometheus that scrapes the agent, as Grafana's server "
                                f"reaches it (default {DEFAULT_PROMETHEUS_URL})")
    provisioning.add_argument("--datasource-name", default=DEFAULT_DATASOURCE_NAME,
                           metavar="NAME",
                           help="the data source's name in Grafana's menus (default "
                                f"{DEFAULT_DATASOURCE_NAME}); its uid is always "
                                f"{DATASOURCE_UID}")
    provisioning.add_argument("--timeout", type=seconds(0, above=True),
                           default=DEFAULT_TIMEOUT_SECONDS, metavar="SECONDS",
                           help="how long to wait for each answer from Grafana (default "
                                f"{DEFAULT_TIMEOUT_SECONDS:g})")


# --- arguments ----------------------------------------------------------------------


def parse_url(text: str, option: str) -> GrafanaUrl:
    """An http(s) base URL, or a UsageError saying what is wrong with it."""
    example = "e.g. http://localhost:3000" if option == "--url" else \
        f"e.g. {DEFAULT_PROMETHEUS_URL}"
    try:
        parts = urlsplit(text.strip())
        port = parts.port
    except ValueError as error:  # a port that is not a number, or a stray bracket
        raise UsageError(f"{option} {text!r} is not a URL ({error})", example) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"{option} {text!r} is not an http:// or https:// URL", example)
    if parts.username is not None or parts.password is not None:
        raise UsageError(f"{option} {text!r} has credentials in it",
                         "give them with --user and --password, or --token")
    if parts.query or parts.fragment:
        raise UsageError(f"{option} {text!r} has a query or fragment",
                         f"give the address only, {example}")
    return GrafanaUrl(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))


def _credential(args: argparse.Namespace) -> tuple[Credential, str]:
    """The credential, and the hint for when Grafana refuses it."""
    basic = args.user is not None or args.password is not None
    if args.token is not None and basic:
        raise UsageError("give --token, or --user and --password, not both",
                         "a token alone is enough")
    if args.token is not None:
        if not args.token:
            raise UsageError("--token is empty", "give the service account token")
        return args.token, "check --token: a service account token, still valid"
    if basic:
        if not args.user or args.password is None:
            raise UsageError("--user and --password go together", "give both, or --token")
        return (args.user, args.password), \
            "check --user and --password (and that Grafana allows basic auth)"
    token = os.environ.get(TOKEN_ENV, "")
    if token:
        return token, f"check ${TOKEN_ENV}: a service account token, still valid"
    raise UsageError("no Grafana credentials",
                     f"give --token (or set ${TOKEN_ENV}), or --user and --password")


# --- the command ------------------------------------------------------------------------


def grafana_command(args: argparse.Namespace, out: TextIO) -> int:
    if args.grafana_command != "provision":
        raise UsageError("no grafana action given",
                         "use e.g. `dlprof-agent grafana provision --url URL --token TOKEN`")
    url = parse_url(args.url, "--url")
    prometheus = parse_url(args.prometheus_url, "--prometheus-url")
    credential, refused_hint = _credential(args)
    folder = args.folder.strip()
    name = args.datasource_name.strip()
    if not folder or not name:
        raise UsageError("--folder and --datasource-name cannot be empty",
                         f"leave them out for {DEFAULT_FOLDER} and {DEFAULT_DATASOURCE_NAME}")
    dashboards = shipped_dashboards()
    grafana = GrafanaSession(url, credential, refused_hint=refused_hint, timeout=args.timeout)
    overview = provision(grafana, dashboards, folder=folder, datasource_name=name,
                         prometheus_url=prometheus.base, out=out)
    out.write(f"overview: {overview}\n")
    return ExitCode.FINISHED


def run(args: argparse.Namespace) -> int:
    return grafana_command(args, sys.stdout)
