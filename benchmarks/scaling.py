"""Scaling: how the agent's cost grows with target processes, threads per
target, layers and series, fitted by least squares to a fixed cost plus a cost
per unit, and where it stops being lightweight (1% of a core).

The agent's own code runs here, in this process, against real processes:
a sampling pass (the agent core, agent.core.Agent, over collectors.process and
collectors.host, the way `attach` builds it) of a busy launcher with N-1
children, or of one process with T threads; then one render of that snapshot
as the agent answers Prometheus (its text writer, gzipped). Per interval the
agent does one pass and, scraped at the same rate, one render: that sum is its
cost. Layers: the probe
thread's snapshot and encoding (in the job) and the agent's decoding and
rendering (in the agent), for L layer names. Series: rendering benchmarks.exposition's
node snapshots. Costs are CPU time of the measuring thread.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from prometheus_client.registry import Collector, CollectorRegistry

from benchmarks.common import (
    PROMETHEUS_HEADERS,
    Column,
    Fit,
    HostBusy,
    Option,
    Processes,
    Progress,
    Result,
    Table,
    fit_line,
    int_list,
    load_average,
    percentile,
    positive_int,
)
from dlprof_agent.collectors.target import Target
from dlprof_agent.exporters.http import render_for

NAME = "scaling"
TITLE = "Scaling"
SUMMARY = ("the agent's CPU per interval against targets, threads per target, layers and "
           "series, fitted to fixed + per-unit costs; where it passes 1% of a core")
TARGETS = "lightweight: below 1% of a core at 1 s (reported as the count where it passes)"
ONE_PERCENT = 0.01
# In the job a kernel record costs what probe.md measures on synthetic buffers; in
# the agent kernels are series like any other (at most 200 per GPU, times 2
# families), priced by the series row. A real GPU's figures are owed.
KERNELS_OWED = "owed: a GPU run (per record: probe.md; per series: the series row)"

OPTIONS = (
    Option("--targets", [1, 2, 4, 8, 16, 32], [1, 3], "target processes (launcher + "
           "children)", int_list, "LIST"),
    Option("--threads", [1, 4, 16, 64], [1, 4], "threads in one target process", int_list,
           "LIST"),
    Option("--layers", [0, 64, 128, 256, 513], [0, 64], "layer names in the probe's answer "
           "(513: the cap, 512 and other)", int_list, "LIST"),
    Option("--series", [100, 300, 1000, 3000, 10000], [100, 1000], "series rendered",
           int_list, "LIST"),
    Option("--passes", 50, 5, "timed passes (or renders) per point; the median is kept",
           positive_int, "N"),
)
_ACCEPT = PROMETHEUS_HEADERS.split("\r\n")[0].removeprefix("Accept: ")


NOISE: list[float] = []  # interquartile range over median, per measured point


def _cpu_median(work: Callable[[], object], times: int) -> float:
    samples = []
    for _ in range(times):
        started = time.thread_time()
        work()
        samples.append(time.thread_time() - started)
    middle = statistics.median(samples)
    if middle > 0 and len(samples) >= 4:
        NOISE.append((percentile(samples, 75) - percentile(samples, 25)) / middle)
    return middle


def _series(registry: CollectorRegistry) -> int:
    from prometheus_client import generate_latest

    return sum(1 for line in generate_latest(registry).splitlines()
               if line and not line.startswith(b"#"))


def agent_costs(pid: int, passes: int) -> tuple[float, float, int]:
    """CPU per sampling pass and per render of ``pid``'s tree, and its series."""
    from dlprof_agent.agent.core import Agent, AgentOptions, OneTarget
    from dlprof_agent.collectors.error_log import ErrorLog
    from dlprof_agent.collectors.host import HostCollector
    from dlprof_agent.collectors.process import ProcessCollector
    from dlprof_agent.exporters.prometheus import NodeCollector

    now = [0.0]  # the collector's clock: one interval (1 s) per pass, so it rescans
    # for new children every fifth pass, as it does at a 1 s interval.
    errors = ErrorLog(("process", "host"))
    agent = Agent(AgentOptions(gpu=False), chooser=OneTarget(Target.of(pid)), host=HostCollector(),
                  gpu=None, errors=errors)
    agent.scan()
    agent.targets[pid].processes = ProcessCollector(Target.of(pid), errors=errors,
                                                    clock=lambda: now[0])

    def one_pass() -> None:
        now[0] += 1.0
        agent.sample_once()

    for _ in range(6):
        one_pass()  # the first passes find the children and open their files
    pass_cost = _cpu_median(one_pass, passes)
    registry = CollectorRegistry()
    registry.register(NodeCollector(lambda: agent.latest, interval_seconds=1.0))
    render_cost = _cpu_median(lambda: render_for(registry, _ACCEPT, gzipped=True), passes)
    return pass_cost, render_cost, _series(registry)


def _busy(processes: Processes, threads: int, children: int, duty: float
          ) -> subprocess.Popen[str]:
    process = processes.start([sys.executable, "-m", "dlprof_agent.workloads.busy",
                               "--threads", str(threads), "--children", str(children),
                               "--duty", f"{duty:g}", "--seconds", "3600"],
                              stdout=subprocess.PIPE,
                              stop_signal=signal.SIGINT)  # busy stops its children on Ctrl-C
    assert process.stdout is not None
    process.stdout.readline()  # printed once its threads and children run
    return process


def layer_costs(layers: int, passes: int) -> tuple[float, float]:
    """CPU per poll in the job (snapshot + encode) and in the agent (decode +
    render of the probe's families), with ``layers`` layer names."""
    from dlprof_agent.exporters.probe_families import probe_families
    from dlprof_agent.probe.protocol import HEADER, encode
    from dlprof_agent.probe.recorder import Recorder
    from dlprof_agent.probe_link.samples import ProbeSample

    recorder = Recorder(warmup_steps=0)
    for step in range(20):
        recorder.step_boundary("optimizer", now=step * 0.01)
    names = [f"model.blocks.{i}.conv" for i in range(layers)]
    for name in names:
        recorder.add_layer_time(name, "forward", 1e-4)
        recorder.add_layer_time(name, "backward", 2e-4)

    def answer() -> bytes:
        return encode({"ok": True, "probe": recorder.snapshot(), "settings": {},
                       "dropped": {}})

    frame = answer()

    class Probe(Collector):
        def collect(self) -> Any:
            sample = ProbeSample.from_reply(1, json.loads(frame[HEADER.size:]))
            return probe_families(1, True, sample)

    registry = CollectorRegistry()
    registry.register(Probe())
    render_cost = _cpu_median(lambda: render_for(registry, _ACCEPT, gzipped=True), passes)
    return _cpu_median(answer, passes), render_cost


def series_cost(series: int, passes: int) -> tuple[float, int]:
    from benchmarks.exposition import node_snapshot, registry_for, shape_for

    shape, count = shape_for(series)
    registry = registry_for(node_snapshot(shape))
    return _cpu_median(lambda: render_for(registry, _ACCEPT, gzipped=True), passes), count


def _where(fit: Fit, interval: float, cap: float | None = None) -> str:
    """Where the fitted cost per interval passes 1% of a core, in words."""
    limit = ONE_PERCENT * interval
    if fit.intercept >= limit:
        return "already at 0 (the fixed cost alone)"
    where = fit.solve(limit)
    if where is None:
        return "never (cost does not grow)"
    if cap is not None and where > cap:
        return f"never (≈{where:,.0f}, past the cap of {cap:.0f})"
    if where < 1:
        return f"already at 1 (≈{where:.2f})"
    return f"≈{where:,.0f}"


def run(settings: dict[str, Any]) -> Result:
    result = Result(NAME, TITLE, __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
                    settings["smoke"], settings)
    passes = int(settings["passes"])
    progress = Progress(NAME, sum(len(settings[k]) for k in (
        "targets", "threads", "layers", "series")))
    busy = HostBusy()
    load_start = load_average()
    busy.start()

    points = Table("points", "Measured points: CPU per sampling pass and per render", [
        Column("dimension", "dimension"), Column("x", "x", "int"),
        Column("series", "series", "int"), Column("pass_cost", "sampling pass", "ms"),
        Column("render_cost", "render", "ms"), Column("total", "per interval", "ms"),
        Column("share_1s", "% of a core at 1 s", "pct")])
    curves: dict[str, tuple[list[float], list[float]]] = {}

    def add(dimension: str, x: int, series: int | None, pass_cost: float | None,
            render_cost: float) -> None:
        total = (pass_cost or 0.0) + render_cost
        points.rows.append({"dimension": dimension, "x": x, "series": series,
                            "pass_cost": pass_cost, "render_cost": render_cost,
                            "total": total, "share_1s": total})
        key = dimension.split(" (", maxsplit=1)[0].replace(" ", "_")
        result.figures[f"{key}.{x}.per_interval_seconds"] = total
        xs, ys = curves.setdefault(dimension, ([], []))
        xs.append(float(x))
        ys.append(total)
        progress.advance(f"{dimension} {x}: {total * 1e3:.3f} ms per interval")

    for count in settings["targets"]:
        if count < 1:
            raise SystemExit("scaling: --targets counts processes: give 1 or more")
        with Processes() as processes:
            # Light load: many children on few cores must not starve the measuring thread.
            launcher = _busy(processes, 1, count - 1, min(0.02, 0.3 / count))
            pass_cost, render_cost, series = agent_costs(launcher.pid, passes)
        add("target processes", count, series, pass_cost, render_cost)
    for threads in settings["threads"]:
        with Processes() as processes:
            target = _busy(processes, threads, 0, min(0.02, 0.3 / max(threads, 1)))
            pass_cost, render_cost, series = agent_costs(target.pid, passes)
        add("threads in the target", threads, series, pass_cost, render_cost)
    probe_side: list[float] = []
    for layers in settings["layers"]:
        in_job, in_agent = layer_costs(layers, passes)
        probe_side.append(in_job)
        add("layers (agent side)", layers, None, None, in_agent)
    for series in settings["series"]:
        cost, count = series_cost(series, passes)
        add("series (render only)", count, count, None, cost)
    busy.stop()
    load_end = load_average()
    result.tables.append(points)

    fits = Table("fits", "Fitted: cost per interval = fixed + per unit times x; where it "
                 "passes 1% of a core", [
                     Column("dimension", "dimension"), Column("fixed", "fixed", "us"),
                     Column("per_unit", "per unit", "us"), Column("r2", "r²", "float"),
                     Column("at_1s", "passes 1% at 1 s at"),
                     Column("at_01s", "at 0.1 s")])
    caps = {"layers (agent side)": 513.0}
    for dimension, (xs, ys) in curves.items():
        if len(set(xs)) < 2:
            continue
        fit = fit_line(xs, ys)
        fits.rows.append({"dimension": dimension, "fixed": fit.intercept,
                          "per_unit": fit.slope, "r2": fit.r2,
                          "at_1s": _where(fit, 1.0, caps.get(dimension)),
                          "at_01s": _where(fit, 0.1, caps.get(dimension))})
        key = dimension.split(" (")[0].replace(" ", "_")
        result.figures[f"{key}.per_unit_seconds"] = fit.slope  # noise can make either < 0
        result.figures[f"{key}.fixed_seconds"] = fit.intercept
    layer_xs = [float(x) for x in settings["layers"]]
    if len(set(layer_xs)) >= 2:
        fit = fit_line(layer_xs, probe_side)
        fits.rows.append({"dimension": "layers (probe side, in the job)",
                          "fixed": fit.intercept, "per_unit": fit.slope, "r2": fit.r2,
                          "at_1s": _where(fit, 1.0, 513), "at_01s": _where(fit, 0.1, 513)})
    fits.rows.append({"dimension": "kernels", "at_1s": KERNELS_OWED, "at_01s": KERNELS_OWED})
    fits.notes.append(
        "Targets and threads include the render of their series (one scrape per "
        "interval); at 0.1 s the pass cost is taken as at 1 s, a slight overestimate "
        "(the collector looks for new children every 5 s, so less often per pass). The "
        "series row counts the render alone, on a realistic node; the layers rows the probe "
        "part alone. A real agent adds the Python interpreter's own idle cost (see the "
        "footprint benchmark).")
    result.tables.append(fits)
    result.owed.append(f"Agent cost against kernels per step: {KERNELS_OWED}.")
    noise = statistics.median(NOISE) if NOISE else 0.0
    result.noise = {"median_iqr_over_median": noise, "host_busy_share": busy.shares[0],
                    "load_average_start": load_start[0], "load_average_end": load_end[0]}
    result.noise_summary = (
        f"each point is the median of {passes} timings of CPU time, which other load "
        f"inflates less than wall time; their interquartile range is {noise:.0%} of the "
        f"median (median over points). The machine's cores were {busy.shares[0]:.0%} busy "
        f"(targets included); load average {load_start[0]:.2f} at the start, "
        f"{load_end[0]:.2f} at the end.")
    return result
