"""The job dashboard on a real Prometheus: every panel's query answers with data, and
the straggler alert fires for the slow rank only, with its cause.

The agent does not serve `job_id` and `rank` yet on this code (they come with the
identity work, docs/fleet-identity.md), so two small HTTP servers stand in for the
agents of a two-node job: they serve the step, phase, finding and identity series in
the labels the metric contract gives them, counting up on the real clock, and
Prometheus scrapes them and evaluates `dlprof-agent rules --rate-window 10s --for 5s`.
Rank 1 spends 30 ms a step in its input, rank 0 waits for it in the exchange."""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from dlprof_agent.cli.main import main
from dlprof_agent.exporters.prometheus_rules import STRAGGLER_ALERT
from dlprof_agent.grafana import build as dashboards
from tests.conftest import PROMETHEUS, Prometheus, http_get, running_prometheus, wait_for
from tests.test_dashboards import LABEL_VALUES, substitute

pytestmark = pytest.mark.e2e

STEP_SECONDS = 0.05
SAMPLES_PER_STEP = 32
# Milliseconds per step of each phase; both ranks' steps take 50 ms.
PHASES_MS = {
    0: {"forward": 5, "backward": 10, "optimizer": 3, "other": 2, "exchange": 30},
    1: {"forward": 5, "backward": 10, "optimizer": 3, "other": 30, "exchange": 2},
}


def exposition(rank: int, elapsed: float) -> str:
    """What one rank's agent would serve `elapsed` seconds into the job."""
    pid = str(100 * (rank + 1))
    ident = f'pid="{pid}",job_id="train",rank="{rank}"'
    steps = elapsed / STEP_SECONDS
    lines = [
        f'dlprof_target_info{{{ident},local_rank="0",node_rank="{rank}",world_size="2",'
        f'restart_count="0",node="node{rank}",role="rank",pod_uid="",container_id="",'
        'pod="",namespace=""} 1',
        f"dlprof_target_world_size{{{ident}}} 2",
        f'dlprof_target_up{{pid="{pid}"}} 1',
        f'dlprof_probe_up{{pid="{pid}"}} 1',
        f'dlprof_steps_total{{{ident},phase="warmup"}} 10',
        f'dlprof_steps_total{{{ident},phase="steady"}} {steps}',
        f'dlprof_samples_total{{{ident},phase="steady"}} {steps * SAMPLES_PER_STEP}',
        f'dlprof_step_duration_seconds_bucket{{{ident},le="+Inf"}} {steps}',
        f"dlprof_step_duration_seconds_sum{{{ident}}} {steps * STEP_SECONDS}",
        f"dlprof_step_duration_seconds_count{{{ident}}} {steps}",
        f'dlprof_finding{{{ident},finding="cpu_contention",severity="warning"}} 0',
    ]
    lines += [f'dlprof_step_phase_seconds_total{{{ident},phase="{phase}"}} {steps * ms / 1000}'
              for phase, ms in PHASES_MS[rank].items()]
    return "\n".join(lines) + "\n"


def serve_rank(rank: int, started: float) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = exposition(rank, time.monotonic() - started).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def job_prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    """Prometheus scraping the two ranks' stand-in agents, with the command's rules."""
    if PROMETHEUS is None:
        pytest.fail("the prometheus server is not installed (Debian package `prometheus`)")

    started = time.monotonic()
    servers = [serve_rank(rank, started) for rank in PHASES_MS]
    assert main(["rules", "--rate-window", "10s", "--for", "5s",
                 "-o", str(tmp_path / "rules.yml")]) == 0
    targets = ", ".join(f"'127.0.0.1:{server.server_address[1]}'" for server in servers)
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "rule_files: [rules.yml]\n"
        "scrape_configs:\n"
        "  - job_name: dlprof\n"
        f"    static_configs: [{{targets: [{targets}]}}]\n")
    try:
        with running_prometheus(tmp_path / "prometheus.yml", tmp_path / "data") as server:
            yield server
    finally:
        for rank_server in servers:
            rank_server.shutdown()
            rank_server.server_close()


def test_every_job_panel_has_data_and_the_slow_rank_is_the_straggler(
        job_prometheus: Prometheus) -> None:
    prometheus = job_prometheus
    firing = f'ALERTS{{alertname="{STRAGGLER_ALERT}",alertstate="firing"}}'
    alerts = wait_for(lambda: prometheus.query(firing), "the straggler alert to fire", 90)
    assert [(a["metric"]["job_id"], a["metric"]["rank"], a["metric"]["cause"])
            for a in alerts] == [("train", "1", "input")]

    model = dashboards.dashboards()["job.json"]
    empty = [panel["title"] for panel in dashboards.panels(model)
             if not all(prometheus.query(substitute(target["expr"]))
                        for target in panel["targets"])]
    assert empty == [], "no series for these panels of the job dashboard"

    (variable,) = [v for v in model["templating"]["list"] if v["type"] == "query"]
    match = LABEL_VALUES.fullmatch(variable["query"])
    assert match, variable["query"]
    url = (f"{prometheus.url}/api/v1/label/{match['label']}/values?"
           + urllib.parse.urlencode({"match[]": match["selector"]}))
    assert json.loads(http_get(url))["data"] == ["train"]
    # Rank 0 waits for rank 1 in the exchange; it never becomes a straggler.
    assert not prometheus.query(f'ALERTS{{alertname="{STRAGGLER_ALERT}",rank="0"}}')
