"""Scrape cost: how long /metrics takes to render and serve, and how big it is,
at about 100, 1,000 and 10,000 series, with 1 and 4 concurrent scrapers; then
the same while a training job runs, and the job's slowdown during a scrape storm.

The series are a realistic node's (benchmarks.exposition: jobs, processes,
thread names and up to 512 layers per job) rendered by the agent's real
exporter (NodeCollector) behind its real server (MetricsServer), in a process
of their own, and fetched over HTTP with the headers Prometheus sends. Each
scraper fetches back to back; latency runs from connect to the last byte.
In-process render time (no HTTP) is given beside it. The storm part runs a
PyTorch small CNN (benchmarks.training_job) in blocks, interleaved: no
scrapes, one scrape a second (Prometheus at 1 s), and 4 back-to-back scrapers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from benchmarks.common import (
    CORES,
    PROMETHEUS_HEADERS,
    Column,
    HostBusy,
    Option,
    Processes,
    Progress,
    Result,
    Scraper,
    Table,
    TargetCheck,
    cpu_seconds,
    int_list,
    load_average,
    percentile,
    positive_float,
    positive_int,
    scrape,
    spread,
    stderr_tail,
)
from benchmarks.exposition import node_snapshot, registry_for, shape_for
from benchmarks.overhead import SETTLE_STEPS
from benchmarks.paired import TrainingJob
from dlprof_agent.exporters.http import render_for

NAME = "scrape"
TITLE = "Scrape cost"
SUMMARY = ("/metrics render latency (p50, p99) and payload at 100, 1,000 and 10,000 "
           "series with 1 and 4 scrapers, idle and while training; the job's slowdown "
           "during a scrape storm, and with 100 concurrent scrapers on the other core")
TARGETS = ("/metrics p99 <= 10 ms at 1,000 series; 100 concurrent scrapers change a "
           "pinned 1-thread job's step time by at most 1%, with no drops and no tracebacks")
P99_TARGET_SECONDS = 0.010

PARTS = ("idle", "storm", "crowd")


def _parts(text: str) -> list[str]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or set(parts) - set(PARTS):
        raise argparse.ArgumentTypeError(f"{text!r}: give some of {','.join(PARTS)}")
    return parts


OPTIONS = (
    Option("--series", [100, 1000, 10000], [100, 1000], "about this many series",
           int_list, "LIST"),
    Option("--scrapers", [1, 4], [1, 4], "concurrent scrapers", int_list, "LIST"),
    Option("--cell-seconds", 5.0, 0.5, "scraping time per (series, scrapers) cell",
           positive_float, "S"),
    Option("--renders", 50, 5, "in-process renders per series count", positive_int, "N"),
    Option("--storm-series", 10000, 1000, "series served during the storm rounds",
           positive_int, "N"),
    Option("--rounds", 5, 1, "storm rounds: each configuration once per round",
           positive_int, "N"),
    Option("--block-seconds", 4.0, 0.5, "training time per storm block", positive_float,
           "S"),
    Option("--threads", CORES, 1, "the job's intra-op threads", positive_int, "N",
           "the number of cores"),
    Option("--batch", 32, 8, "the job's batch", positive_int, "N"),
    Option("--parts", list(PARTS), list(PARTS),
           "which parts to run: idle (latency), storm (4 scrapers, job on every core), "
           "crowd (pinned)", _parts, "LIST"),
    Option("--crowd", 100, 20, "concurrent scrapers in the pinned crowd rounds", positive_int,
           "N"),
)
CROWD_TARGET = 0.01  # the 1-thread job's step time changes by at most 1%

STORM_CONFIGS = (("quiet", "no scrapes", 0, 0.0), ("1hz", "1 scraper, once a second", 1, 1.0),
                 ("storm", "4 scrapers, back to back", 4, 0.0))


class Server:
    """A benchmarks.exposition process serving about ``series`` series."""

    def __init__(self, processes: Processes, series: int) -> None:
        self.process = processes.start([sys.executable, "-m", "benchmarks.exposition",
                                        "--series", str(series)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.process.stdout is not None
        words = self.process.stdout.readline().split()
        if len(words) != 4 or words[0] != "port":
            raise RuntimeError(f"the /metrics server for {series} series did not start")
        self.port, self.series = int(words[1]), int(words[3])


def _latencies(port: int, scrapers: int, seconds: float) -> tuple[list[float], int]:
    """Back-to-back scrapes from ``scrapers`` threads for ``seconds``."""
    results: list[list[float]] = [[] for _ in range(scrapers)]
    failures = [0] * scrapers
    stop = threading.Event()

    def loop(index: int) -> None:
        while not stop.is_set():
            try:
                answer = scrape(port)
            except OSError:
                failures[index] += 1
                continue
            if answer.status == 200:
                results[index].append(answer.seconds)
            else:
                failures[index] += 1

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(scrapers)]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(60)
    return [x for r in results for x in r], sum(failures)


@dataclass(frozen=True)
class Render:
    seconds: float  # CPU per render as the agent serves Prometheus (its text writer, gzip)
    text_seconds: float  # prometheus_client's OpenMetrics writer, for comparison
    payload_bytes: int
    gzip_bytes: int


def _render(series: int, renders: int) -> Render:
    """Render in-process, without HTTP: the exporter's own cost."""
    registry = registry_for(node_snapshot(shape_for(series)[0]))
    accept = PROMETHEUS_HEADERS.split("\r\n")[0].removeprefix("Accept: ")
    payload = render_for(registry, accept, gzipped=False)[1]
    sent = render_for(registry, accept, gzipped=True)[1]
    openmetrics, _ = choose_encoder("application/openmetrics-text; version=1.0.0")

    def cpu(render: Callable[[CollectorRegistry], bytes]) -> float:
        times = []
        for _ in range(renders):
            started = time.thread_time()
            render(registry)
            times.append(time.thread_time() - started)
        return statistics.median(times)

    return Render(cpu(lambda r: render_for(r, accept, gzipped=True)[1]), cpu(openmetrics),
                  len(payload), len(sent))


def run(settings: dict[str, Any]) -> Result:
    result = Result(NAME, TITLE, __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
                    settings["smoke"], settings)
    series_list: list[int] = settings["series"]
    scrapers_list: list[int] = settings["scrapers"]
    rounds = int(settings["rounds"])
    parts: list[str] = settings["parts"]
    if "idle" not in parts:
        series_list = []
    progress = Progress(NAME, len(series_list) * (1 + len(scrapers_list))
                        + rounds * len(STORM_CONFIGS) * ("storm" in parts)
                        + rounds * 2 * ("crowd" in parts))
    busy = HostBusy()
    load_start = load_average()

    idle = Table("idle", "Idle machine: /metrics over HTTP", [
        Column("series", "series", "int"), Column("shape", "node"),
        Column("payload_bytes", "payload", "kib"),
        Column("gzip_bytes", "sent (gzip)", "kib"),
        Column("render_seconds", "render + gzip in-process (CPU)", "ms"),
        Column("text_seconds", "prometheus_client OpenMetrics", "ms"),
        Column("scrapers", "scrapers", "int"), Column("p50", "latency p50", "ms"),
        Column("p99", "p99", "ms"), Column("rate", "scrapes", "rate"),
        Column("server_cpu_per_scrape", "server CPU per scrape", "ms"),
        Column("verdict", "p99 ≤ 10 ms (1,000 series)", "met")])
    with Processes() as processes:
        for series in series_list:
            render = _render(series, int(settings["renders"]))
            server = Server(processes, series)
            shape = shape_for(series)[0]
            progress.advance(f"{server.series} series: render {render.seconds * 1e3:.2f} ms")
            result.figures[f"{series}.payload_bytes"] = float(render.payload_bytes)
            result.figures[f"{series}.render_seconds"] = render.seconds
            for scrapers in scrapers_list:
                busy.start()
                cpu_before = cpu_seconds(server.process.pid)
                latencies, failures = _latencies(server.port, scrapers,
                                                 float(settings["cell_seconds"]))
                server_cpu = cpu_seconds(server.process.pid) - cpu_before
                busy.stop()
                if not latencies:
                    raise RuntimeError(f"no scrape of {series} series succeeded")
                p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
                row: dict[str, Any] = {
                    "series": server.series, "shape": shape.describe(),
                    "payload_bytes": render.payload_bytes, "gzip_bytes": render.gzip_bytes,
                    "render_seconds": render.seconds, "text_seconds": render.text_seconds,
                    "scrapers": scrapers, "p50": p50, "p99": p99,
                    "rate": len(latencies) / float(settings["cell_seconds"]),
                    "server_cpu_per_scrape": server_cpu / len(latencies) or None}
                if failures:
                    result.notes.append(f"{failures} scrape(s) of {series} series with "
                                        f"{scrapers} scrapers failed")
                if series == 1000 and scrapers == 1:
                    row["verdict"] = p99 <= P99_TARGET_SECONDS
                    result.targets.append(TargetCheck(
                        "/metrics p99 at 1,000 series", "≤ 10 ms (idle, one scraper)",
                        f"{p99 * 1e3:.2f} ms (p50 {p50 * 1e3:.2f} ms, {len(latencies)} "
                        "scrapes)", p99 <= P99_TARGET_SECONDS))
                idle.rows.append(row)
                result.figures[f"{series}.scrapers{scrapers}.p50_seconds"] = p50
                result.figures[f"{series}.scrapers{scrapers}.p99_seconds"] = p99
                progress.advance(f"{server.series} series, {scrapers} scraper(s): p50 "
                                 f"{p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms")
            processes.stop(server.process)
    idle.notes.append(
        "The scrapers send Prometheus's headers, so the agent answers in the text format, "
        "written by its own writer (exporters.text), gzipped at level 1; the payload is "
        "the uncompressed size. The server here renders on every scrape (the agent itself "
        "renders each sample at most once, however many scrapers). Server CPU per scrape "
        "is the server process's CPU time over the cell divided by the scrapes served.")
    if series_list:
        result.tables.append(idle)
    if "storm" in parts:
        result.tables.append(_storm(settings, progress, busy, result))
    if "crowd" in parts:
        result.tables.append(_crowd(settings, progress, busy, result))
    load_end = load_average()
    result.noise.update(host_busy_share=statistics.fmean(busy.shares),
                        load_average_start=load_start[0], load_average_end=load_end[0])
    spreads = [f"the {part} job's no-scrape blocks spread by {result.noise[key]:.1%} "
               "across rounds (max-min over median); "
               for part, key in (("storm", "quiet_spread"), ("pinned", "crowd_quiet_spread"))
               if key in result.noise]
    result.noise_summary = (
        "".join(spreads) + "the machine's cores were "
        f"{statistics.fmean(busy.shares):.0%} busy while measuring (scrapers, server and "
        f"job included); load average {load_start[0]:.2f} at the start, "
        f"{load_end[0]:.2f} at the end.")
    return result


def _storm(settings: dict[str, Any], progress: Progress, busy: HostBusy, result: Result
           ) -> Table:
    rounds = int(settings["rounds"])
    steps_by_config: dict[str, list[float]] = {key: [] for key, *_ in STORM_CONFIGS}
    latencies: dict[str, list[float]] = {key: [] for key, *_ in STORM_CONFIGS}
    with Processes() as processes:
        server = Server(processes, int(settings["storm_series"]))
        job = TrainingJob(processes, "pytorch", "small-cnn", batch=int(settings["batch"]),
                          threads=int(settings["threads"]),
                          warmup_seconds=0.5 if settings["smoke"] else 3.0)
        steps = max(SETTLE_STEPS + 10,
                    round(float(settings["block_seconds"]) / job.step_seconds))
        for round_index in range(rounds):
            shift = round_index % len(STORM_CONFIGS)
            for key, _, scrapers, period in STORM_CONFIGS[shift:] + STORM_CONFIGS[:shift]:
                pool = [Scraper(server.port, period=period).start() for _ in range(scrapers)]
                busy.start()
                try:
                    durations = job.run_block(steps + SETTLE_STEPS)
                finally:
                    for scraper in pool:
                        scraper.stop()
                busy.stop()
                steps_by_config[key].append(statistics.median(durations[SETTLE_STEPS:]))
                for scraper in pool:
                    latencies[key] += scraper.latencies
                progress.advance(f"training, round {round_index + 1}: {key} "
                                 f"{steps_by_config[key][-1] * 1e3:.2f} ms/step")
    quiet = steps_by_config["quiet"]
    result.noise["quiet_spread"] = spread(quiet)
    table = Table("training", f"While a PyTorch small CNN trains (batch {job.batch}, "
                  f"{settings['threads']} threads): {server.series} series, {rounds} round(s)", [
                      Column("config", "scrapes"), Column("step", "job's median step", "ms"),
                      Column("slowdown_median", "job slowdown: median", "spct"),
                      Column("slowdown_min", "min", "spct"),
                      Column("slowdown_max", "max", "spct"),
                      Column("p50", "scrape p50", "ms"), Column("p99", "p99", "ms"),
                      Column("scrapes", "scrapes", "int")])
    for key, label, _, _ in STORM_CONFIGS:
        ratios = [on / off - 1 for on, off in zip(steps_by_config[key], quiet, strict=True)]
        row: dict[str, Any] = {"config": label, "step": statistics.median(steps_by_config[key]),
                               "scrapes": len(latencies[key])}
        if key != "quiet":
            row.update(slowdown_median=statistics.median(ratios), slowdown_min=min(ratios),
                       slowdown_max=max(ratios))
            result.figures[f"training.{key}.slowdown_median"] = statistics.median(ratios)
        if latencies[key]:
            row.update(p50=percentile(latencies[key], 50), p99=percentile(latencies[key], 99))
            result.figures[f"training.{key}.p99_seconds"] = row["p99"]
        result.figures[f"training.{key}.step_seconds"] = row["step"]
        table.rows.append(row)
    table.notes.append(
        f"The job uses {settings['threads']} thread(s) on {CORES} cores: during a storm "
        "the server and the scrapers take CPU from it, which is the slowdown shown. The "
        "agent's server runs in the agent's process, never in the job's.")
    return table


def _pin(pid: int, cores: set[int]) -> None:
    """Every thread of ``pid`` (threads it starts later inherit it) onto ``cores``."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task), cores)


CROWD_NICE = 19


def _niced_scrapers(port: int, count: int) -> list[Scraper]:
    """``count`` back-to-back scrapers at nice 19, started from a thread that lowered
    itself first (threads inherit it): they stand in for Prometheus servers on other
    machines, and must not push the machine's other work onto the job's core."""
    pool: list[Scraper] = []

    def start() -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), CROWD_NICE)
        pool.extend(Scraper(port, period=0.0).start() for _ in range(count))

    starter = threading.Thread(target=start)
    starter.start()
    starter.join()
    return pool


def _crowd(settings: dict[str, Any], progress: Progress, busy: HostBusy, result: Result
           ) -> Table:
    """A 1-thread job pinned to core 0, ``--crowd`` back-to-back scrapers pinned to the
    other cores, and the server as the agent runs (renders once per 1 s sample, serving
    threads at nice 10), free to run anywhere: the job's step time with and
    without the crowd, in interleaved blocks."""
    rounds, crowd = int(settings["rounds"]), int(settings["crowd"])
    table = Table("crowd", f"{crowd} concurrent scrapers against a 1-thread job, pinned", [
        Column("config", "scrapes"), Column("step", "job's median step", "ms"),
        Column("cpu", "job CPU per step", "ms"),
        Column("change_median", "step change: median", "spct"),
        Column("change_min", "min", "spct"), Column("change_max", "max", "spct"),
        Column("scrapes", "scrapes answered", "int"), Column("drops", "failed", "int"),
        Column("p99", "scrape p99", "ms"),
        Column("verdict", "≤ 1%, no drops, no tracebacks", "met")])
    if CORES < 2:
        table.notes.append("Needs 2 cores: one for the job, one for the scrapers; skipped.")
        progress.advance("crowd: skipped (one core)")
        return table
    others = set(range(1, CORES))
    steps: dict[str, list[float]] = {"quiet": [], "crowd": []}
    cpu: dict[str, list[float]] = {"quiet": [], "crowd": []}
    answered, drops, latencies = 0, 0, []
    own_affinity = os.sched_getaffinity(0)
    with Processes() as processes:
        server = processes.start([sys.executable, "-m", "benchmarks.exposition", "--series",
                                  str(settings["storm_series"]), "--as-agent", "1"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert server.stdout is not None
        words = server.stdout.readline().split()
        if len(words) != 4 or words[0] != "port":
            raise RuntimeError("the /metrics server for the crowd did not start")
        port, series = int(words[1]), int(words[3])
        job = TrainingJob(processes, "pytorch", "small-cnn", batch=int(settings["batch"]),
                          threads=1, warmup_seconds=0.5 if settings["smoke"] else 3.0)
        _pin(job.pid, {0})
        _pin(os.getpid(), others)  # the scrapers are this process's threads
        try:
            block = max(SETTLE_STEPS + 10,
                        round(float(settings["block_seconds"]) / job.step_seconds))
            for round_index in range(rounds):
                order = ("quiet", "crowd") if round_index % 2 == 0 else ("crowd", "quiet")
                for key in order:
                    pool = _niced_scrapers(port, crowd if key == "crowd" else 0)
                    busy.start()
                    before = cpu_seconds(job.pid)
                    try:
                        durations = job.run_block(block + SETTLE_STEPS)
                    finally:
                        job_cpu = cpu_seconds(job.pid) - before
                        for scraper in pool:
                            scraper.stop()
                    busy.stop()
                    steps[key].append(statistics.median(durations[SETTLE_STEPS:]))
                    cpu[key].append(job_cpu / len(durations))
                    for scraper in pool:
                        answered += len(scraper.latencies)
                        drops += scraper.errors
                        latencies += scraper.latencies
                    progress.advance(f"crowd, round {round_index + 1}: {key} "
                                     f"{steps[key][-1] * 1e3:.2f} ms/step")
            tracebacks = stderr_tail(server, 100000).count("Traceback")
        finally:
            _pin(os.getpid(), own_affinity)
    result.noise["crowd_quiet_spread"] = spread(steps["quiet"])
    changes = [on / off - 1 for on, off in zip(steps["crowd"], steps["quiet"], strict=True)]
    change = statistics.median(changes)
    # The job's own CPU per step: the work it does, which a busy shared machine's
    # competition for the core (the wall time's noise) leaves alone.
    cpu_change = statistics.median(cpu["crowd"]) / statistics.median(cpu["quiet"]) - 1
    met = abs(change) <= CROWD_TARGET and drops == 0 and tracebacks == 0
    table.rows.append({"config": "none", "step": statistics.median(steps["quiet"]),
                       "cpu": statistics.median(cpu["quiet"])})
    table.rows.append({"config": f"{crowd} back to back", "step": statistics.median(
        steps["crowd"]), "cpu": statistics.median(cpu["crowd"]), "change_median": change,
        "change_min": min(changes), "change_max": max(changes), "scrapes": answered,
        "drops": drops, "p99": percentile(latencies, 99) if latencies else None,
        "verdict": met})
    result.figures["crowd.step_change_median"] = change
    result.figures["crowd.job_cpu_per_step_change"] = cpu_change
    result.figures["crowd.drops"] = float(drops)
    result.figures["crowd.tracebacks"] = float(tracebacks)
    result.targets.append(TargetCheck(
        f"{crowd} concurrent scrapers vs a 1-thread job", "step time ±1%, no drops, "
        "no tracebacks", f"{change:+.2%} (min {min(changes):+.2%}, max {max(changes):+.2%}; "
        f"job CPU per step {cpu_change:+.2%}), {drops} drops, {tracebacks} tracebacks, "
        f"{answered} scrapes", met))
    table.notes.append(
        f"{series} series, a new sample each second. The job (PyTorch small CNN, 1 intra-op "
        "thread) is pinned to core 0 and the scrapers (threads of the benchmark process, at "
        "nice 19: they stand in for scrapers on other machines) to the other cores, so the "
        "load generator's own CPU does not land on the job's core; "
        "the server is left free to run anywhere, as an agent would be. Rounds alternate "
        "the order of the two configurations. Where the two cores are hyperthreads of one "
        "physical core, or the machine is shared, the crowd still slows the job through "
        "the shared core, caches and memory bandwidth.")
    return table
