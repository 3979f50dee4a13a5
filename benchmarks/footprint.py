"""Agent footprint: the agent's own CPU seconds per minute and peak resident
memory, at 1 s and 0.1 s intervals, reading 1, 4 and 16 target processes, side
by side with prometheus-process-exporter and prometheus-node-exporter.

Per window, a launcher (dlprof_agent.workloads.busy) with N-1 children is
started, lightly loaded, and these run at once against it: `dlprof-agent attach
LAUNCHER --no-probe`, `dlprof-agent daemon --match` (finding the same N
processes), prometheus-process-exporter matching the same processes (its
defaults: per-thread metrics and smaps on) and prometheus-node-exporter (its
defaults; it does not depend on N). Each is scraped at the agent's rate (1 Hz
at 1 s, 10 Hz at 0.1 s) with the headers Prometheus sends. After a warm-up,
each one's CPU time over the window is read from /proc. Windows repeat,
interleaved; the tables give the median and the spread.
"""

from __future__ import annotations

import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (
    CLOCK_TICKS,
    Column,
    HostBusy,
    Option,
    Processes,
    Progress,
    Result,
    Scraper,
    Table,
    TargetCheck,
    agent_command,
    child_env,
    cpu_seconds,
    float_list,
    free_port,
    get,
    int_list,
    load_average,
    metric_sum,
    metric_value,
    peak_rss_bytes,
    positive_float,
    positive_int,
    spread,
    wait_until,
)

NAME = "footprint"
TITLE = "Agent footprint"
SUMMARY = ("the agent's CPU seconds per minute and peak RSS at 1 s and 0.1 s with 1, 4 and "
           "16 target processes, beside prometheus-process-exporter and node-exporter")
TARGETS = ("CPU <= half of prometheus-process-exporter's on the same targets at the same "
           "rate (~0.9% of a core at 1 Hz), in every cell, and <= 30 MiB RSS")
CPU_TARGET_RATIO = 0.5  # of process-exporter's CPU share
RSS_TARGET_BYTES = 30 * 2**20
NOMINAL_PROCESS_EXPORTER_SHARE = 0.009  # the figure at 1 Hz, when it is not installed

OPTIONS = (
    Option("--targets", [1, 4, 16], [2], "target processes: a launcher and N-1 children",
           int_list, "LIST"),
    Option("--intervals", [1.0, 0.1], [1.0, 0.1], "agent intervals in seconds; scrapes at "
           "the same rate", float_list, "LIST"),
    Option("--seconds", 20.0, 1.5, "measured time per window", positive_float, "S"),
    Option("--warmup", 3.0, 0.5, "left out at the start of a window: imports, first samples",
           positive_float, "S"),
    Option("--repeats", 3, 1, "windows per (targets, interval), interleaved", positive_int,
           "N"),
    Option("--target-threads", 2, 2, "busy threads in the launcher (children have one)",
           positive_int, "N"),
    Option("--target-duty", 0.02, 0.02, "share of time each busy thread computes",
           positive_float, "F"),
)


@dataclass(frozen=True)
class Tool:
    key: str
    label: str


TOOLS = (Tool("attach", "dlprof-agent attach"), Tool("daemon", "dlprof-agent daemon --match"),
         Tool("process-exporter", "prometheus-process-exporter"),
         Tool("node-exporter", "prometheus-node-exporter"))


@dataclass
class Measured:
    cpu_share: float  # of one core over the window
    peak_rss_bytes: int
    scrape_median_seconds: float | None
    sample_pass_seconds: float | None  # the agent's own pass, from its metrics


def _process_exporter_config(directory: Path, token: str) -> Path:
    path = directory / "process-exporter.yml"
    # cmdline entries are regular expressions matched against the joined command line.
    path.write_text("process_names:\n  - name: \"{{.Comm}}\"\n    cmdline:\n"
                    f"    - '{token}'\n")
    return path


def _serving(port: int) -> Callable[[], bool]:
    return lambda: get(port, "/metrics").status == 200


def _start_tools(processes: Processes, *, launcher: int, token: str, environment: str,
                 interval: float, directory: Path, available: dict[str, str]
                 ) -> dict[str, tuple[subprocess.Popen[str], int]]:
    started: dict[str, tuple[subprocess.Popen[str], int]] = {}
    port = free_port()
    started["attach"] = (processes.start(agent_command(
        "attach", str(launcher), "--no-probe", "--interval", str(interval), "--port",
        str(port), "--quiet", "--grace", "0")), port)
    port = free_port()
    # --env keeps out jobs of other users of this machine that match or have a probe.
    started["daemon"] = (processes.start(agent_command(
        "daemon", "--match", token, "--env", f"DLPROF_BENCHMARK={environment}", "--no-probe",
        "--interval", str(interval), "--port", str(port), "--quiet"),), port)
    if available.get("process-exporter"):
        port = free_port()
        started["process-exporter"] = (processes.start(
            [available["process-exporter"], "-config.path",
             str(_process_exporter_config(directory, token)),
             "-web.listen-address", f"127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL), port)
    if available.get("node-exporter"):
        port = free_port()
        started["node-exporter"] = (processes.start(
            [available["node-exporter"], f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL), port)
    for key, (process, port) in started.items():
        wait_until(_serving(port), f"{key} to serve /metrics", alive=process)
    return started


def _sees(key: str, port: int, targets: int) -> Callable[[], bool]:
    return lambda: _processes_seen(key, port) >= targets


def _processes_seen(key: str, port: int) -> float:
    """How many of the targets a tool reads: each must read all of them."""
    body = get(port, "/metrics").body
    if key == "process-exporter":
        return metric_sum(body, "namedprocess_namegroup_num_procs")
    return metric_sum(body, "dlprof_process_info")


def window(targets: int, interval: float, settings: dict[str, Any],
           available: dict[str, str], busy: HostBusy) -> dict[str, Measured]:
    # A run time no one else uses makes the command line unique: the daemon and
    # process-exporter find the targets by it.
    seconds = f"{3600 + random.random():.9f}"
    token = r"dlprof_agent\.workloads\.busy .*--seconds " + re.escape(seconds)
    with Processes() as processes, tempfile.TemporaryDirectory(prefix="footprint-") as tmp:
        launcher = processes.start(
            [sys.executable, "-m", "dlprof_agent.workloads.busy", "--threads",
             str(settings["target_threads"]), "--children", str(targets - 1), "--duty",
             str(settings["target_duty"]), "--seconds", seconds],
            stdout=subprocess.PIPE, env=child_env({"DLPROF_BENCHMARK": seconds}),
            stop_signal=signal.SIGINT)  # busy stops its children on Ctrl-C
        assert launcher.stdout is not None
        launcher.stdout.readline()  # printed once its threads and children run
        tools = _start_tools(processes, launcher=launcher.pid, token=token,
                             environment=seconds, interval=interval, directory=Path(tmp),
                             available=available)
        for key in ("attach", "daemon", "process-exporter"):
            if key in tools:
                process, port = tools[key]
                wait_until(_sees(key, port, targets), f"{key} to read {targets} processes",
                           timeout=30, alive=process)
        scrapers = {key: Scraper(port, period=interval, keep_last_body=key in (
            "attach", "daemon")).start() for key, (_, port) in tools.items()}
        try:
            time.sleep(float(settings["warmup"]))
            before = {key: cpu_seconds(process.pid) for key, (process, _) in tools.items()}
            started = time.monotonic()
            busy.start()
            time.sleep(float(settings["seconds"]))
            busy.stop()
            elapsed = time.monotonic() - started
            after = {key: cpu_seconds(process.pid) for key, (process, _) in tools.items()}
            peaks = {key: peak_rss_bytes(process.pid) for key, (process, _) in tools.items()}
        finally:
            for scraper in scrapers.values():
                scraper.stop()
        measured = {}
        for key in tools:
            scraper = scrapers[key]
            passes = None
            if scraper.last_body:
                passes = metric_value(scraper.last_body, "dlprof_agent_sample_duration_seconds")
            measured[key] = Measured(
                (after[key] - before[key]) / elapsed, peaks[key],
                statistics.median(scraper.latencies) if scraper.latencies else None, passes)
        return measured


def _available() -> tuple[dict[str, str], list[str]]:
    found: dict[str, str] = {}
    missing: list[str] = []
    for key, binary, package in (
            ("process-exporter", "prometheus-process-exporter", "prometheus-process-exporter"),
            ("node-exporter", "prometheus-node-exporter", "prometheus-node-exporter")):
        path = shutil.which(binary)
        if path:
            found[key] = path
        else:
            missing.append(f"{binary}: not installed (apt-get install {package}); its "
                           "column is empty")
    return found, missing


def run(settings: dict[str, Any]) -> Result:
    result = Result(NAME, TITLE, __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
                    settings["smoke"], settings)
    available, missing = _available()
    result.unavailable += missing
    grid = [(n, i) for n in settings["targets"] for i in settings["intervals"]]
    if min(settings["targets"]) < 1:
        raise SystemExit("footprint: --targets counts processes: give 1 or more")
    repeats = int(settings["repeats"])
    progress = Progress(NAME, repeats * len(grid))
    busy = HostBusy()
    load_start = load_average()
    samples: dict[tuple[int, float], list[dict[str, Measured]]] = {cell: [] for cell in grid}
    for repeat in range(repeats):
        for cell in grid[repeat % len(grid):] + grid[:repeat % len(grid)]:
            measured = window(cell[0], cell[1], settings, available, busy)
            samples[cell].append(measured)
            progress.advance(f"{cell[0]} target(s) at {cell[1]:g} s: " + ", ".join(
                f"{key} {m.cpu_share:.2%}" for key, m in measured.items()))
    load_end = load_average()

    table = Table("footprint", "CPU (share of one core, and seconds per minute) and peak "
                  "RSS, median over windows", [
                      Column("targets", "target processes", "int"),
                      Column("interval", "interval / scrape period"),
                      Column("tool", "tool"),
                      Column("cpu_share", "CPU, % of a core", "pct"),
                      Column("cpu_seconds_per_minute", "CPU s/min", "float"),
                      Column("cpu_spread", "spread over windows", "pct"),
                      Column("peak_rss_bytes", "peak RSS", "mib"),
                      Column("sample_pass_seconds", "sampling pass", "ms"),
                      Column("scrape_seconds", "scrape (median)", "ms"),
                      Column("verdict", "CPU ≤ 0.5x process-exporter, RSS ≤ 30 MiB", "met")])
    spreads: list[float] = []
    for cell in grid:
        targets, interval = cell
        windows = samples[cell]
        shares: dict[str, float] = {}
        for tool in TOOLS:
            values = [w[tool.key] for w in windows if tool.key in w]
            if not values:
                continue
            share = statistics.median(v.cpu_share for v in values)
            shares[tool.key] = share
            peak = max(v.peak_rss_bytes for v in values)
            cell_spread = spread([v.cpu_share for v in values]) if len(values) > 1 else 0.0
            if tool.key in ("attach", "daemon") and len(values) > 1:
                spreads.append(cell_spread)
            passes = [v.sample_pass_seconds for v in values if v.sample_pass_seconds]
            scrapes = [v.scrape_median_seconds for v in values if v.scrape_median_seconds]
            row: dict[str, Any] = {
                "targets": targets, "interval": f"{interval:g} s", "tool": tool.label,
                "cpu_share": share, "cpu_seconds_per_minute": 60 * share,
                "cpu_spread": cell_spread, "peak_rss_bytes": peak,
                "sample_pass_seconds": statistics.median(passes) if passes else None,
                "scrape_seconds": statistics.median(scrapes) if scrapes else None}
            if tool.key in ("attach", "daemon"):
                reference = shares.get("process-exporter")
                if reference is None and "process-exporter" in available:
                    reference = statistics.median(w["process-exporter"].cpu_share
                                                  for w in windows)
                basis = "process-exporter here"
                if reference is None and interval == 1.0:
                    reference, basis = NOMINAL_PROCESS_EXPORTER_SHARE, "nominal 0.9%"
                # CPU time is counted in clock ticks: one tick over the window is the
                # resolution, and a difference below it is no difference.
                tick = 1 / (CLOCK_TICKS * float(settings["seconds"]))
                met = None if reference is None else (
                    share <= CPU_TARGET_RATIO * reference + tick
                    and peak <= RSS_TARGET_BYTES)
                row["verdict"] = met
                result.targets.append(TargetCheck(
                    f"{tool.label}, {targets} process(es), {interval:g} s",
                    f"CPU ≤ 0.5x process-exporter ({basis}), RSS ≤ 30 MiB",
                    f"{share:.2%} of a core"
                    + (f" vs {reference:.2%}"
                       + (f" ({share / reference:.2f}x)" if reference > 0 else "")
                       if reference is not None else
                       " (no process-exporter to compare)")
                    + f", {peak / 2**20:.1f} MiB", met))
            slug = f"{targets}x{interval:g}s.{tool.key}"
            result.figures[f"{slug}.cpu_share"] = share
            result.figures[f"{slug}.peak_rss_bytes"] = float(peak)
            table.rows.append(row)
    table.notes.append(
        "process-exporter reads /proc for every process on the machine at each scrape to "
        "find its matches, so its cost also grows with what else runs; the daemon looks "
        "for jobs every 2 s (--scan-interval) the same way.")
    result.tables.append(table)
    result.noise = {"agent_cpu_spread_over_windows": spreads,
                    "host_busy_share": statistics.fmean(busy.shares),
                    "load_average_start": load_start[0], "load_average_end": load_end[0]}
    result.noise_summary = (
        (f"the agent's CPU share varied by up to {max(spreads):.0%} between windows of the "
         "same cell (max-min over median); " if spreads else
         "one window per cell, so no spread between windows; ")
        + f"the machine's cores were {statistics.fmean(busy.shares):.0%} busy during "
        f"windows (targets and tools included); load average {load_start[0]:.2f} at the "
        f"start, {load_end[0]:.2f} at the end.")
    result.notes.append(
        f"Targets: busy launcher with {settings['target_threads']} threads, children with "
        f"one, each computing {float(settings['target_duty']):.0%} of the time. The "
        "scrapes come from the harness, whose own CPU is not counted.")
    return result
