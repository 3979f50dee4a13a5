"""Runs a reference workload over a grid of settings, each point in a fresh
process (thread pools can be sized only once per process), and writes what it
measured: results as CSV and JSON, a table laid out like Shi et al.'s Table 7
(time per mini-batch, one column per value of the swept setting), and plots.

Beside each point's time it records CPU seconds in user and system mode and
context switches per mini-batch: the papers' sign of oversubscription is system
time and involuntary switches rising with the thread count. Under --attach these
are what the agent saw from outside the job over its steady steps (columns
``agent_*``); otherwise the run's own rusage over its timed iterations."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Setting name -> (the `workload run` option, how to read one value)
PARAMETERS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "framework": ("--framework", str.lower),
    "model": ("--model", str.lower),
    "threads": ("--threads", int),
    "inter_op_threads": ("--inter-op-threads", int),
    "batch_size": ("--batch-size", int),
    "layout": ("--layout", str.upper),
    "precision": ("--precision", str.lower),
}


class SweepError(ValueError):
    pass


def parse_param(text: str) -> tuple[str, list[Any]]:
    """``threads=1,2,4`` -> ("threads", [1, 2, 4])."""
    name, _, values = text.partition("=")
    name = name.strip().replace("-", "_")
    if name not in PARAMETERS:
        raise SweepError(f"cannot sweep {name!r}: choose from {', '.join(PARAMETERS)}")
    parse = PARAMETERS[name][1]
    try:
        parsed = [parse(value.strip()) for value in values.split(",") if value.strip()]
    except ValueError:
        raise SweepError(f"bad value in {text!r}: give e.g. {name}=1,2,4") from None
    if not parsed:
        raise SweepError(f"no values in {text!r}: give e.g. {name}=1,2,4")
    return name, parsed


def grid(params: Sequence[tuple[str, list[Any]]]) -> list[dict[str, Any]]:
    names = [name for name, _ in params]
    return [dict(zip(names, values, strict=True))
            for values in itertools.product(*(values for _, values in params))]


def run_point(base_args: Sequence[str], point: dict[str, Any]) -> dict[str, Any]:
    """One `workload run` in a child process."""
    args = [sys.executable, "-m", "dlprof_agent", "workload", "run", *base_args, "--json"]
    for name, value in point.items():
        args += [PARAMETERS[name][0], str(value)]
    started = time.perf_counter()
    result = subprocess.run(args, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise SweepError(f"the run with {point} failed: {last}")
    measured: dict[str, Any] = json.loads(result.stdout)
    agent = measured.pop("agent", None)
    row = {**point, **measured, "wall_seconds": wall}
    if agent is not None:
        row.update(agent_columns(agent))
    return row


def combine_repeats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for a point run several times: the median of every figure, plus
    the spread of the time per mini-batch, which says how noisy the machine was."""
    import statistics  # here: `workload`'s options are read by every command's parser

    row = dict(runs[0])
    for key, first in runs[0].items():
        values = [run.get(key) for run in runs]
        numbers = [float(v) for v in values if isinstance(v, (int, float))]
        if (isinstance(first, (int, float)) and not isinstance(first, bool)
                and key not in PARAMETERS and key != "batch_size"
                and len(numbers) == len(values)):
            row[key] = statistics.median(numbers)
    times = [run["seconds_per_batch"] for run in runs]
    row.update(repeats=len(runs), seconds_per_batch_min=min(times),
               seconds_per_batch_max=max(times))
    return row


def agent_columns(agent: dict[str, Any]) -> dict[str, Any]:
    """The agent's summary as flat columns, per mini-batch over the steady steps."""
    steady = agent.get("steady") or {}
    probe = agent.get("probe") or {}
    return {
        "agent_steps": steady.get("steps"),
        "agent_seconds_per_batch": steady.get("step_seconds"),
        "agent_cpu_user_seconds_per_batch": steady.get("cpu_user_seconds_per_step"),
        "agent_cpu_system_seconds_per_batch": steady.get("cpu_system_seconds_per_step"),
        "agent_context_switches_per_batch": steady.get("context_switches_per_step"),
        "agent_involuntary_switches_per_batch": steady.get("involuntary_switches_per_step"),
        "agent_peak_rss_bytes": agent.get("peak_rss_bytes"),
        "agent_peak_threads": agent.get("peak_threads"),
        "agent_probe_mean_step_seconds": probe.get("mean_step_seconds"),
    }


def cpu_columns(rows: list[dict[str, Any]]) -> tuple[str, str]:
    """Whose CPU figures to show: the agent's when every row has them, else the run's."""
    if rows and all(row.get("agent_cpu_user_seconds_per_batch") is not None for row in rows):
        return "agent_", "seen by the agent"
    return "", "the run's own rusage"


def table(rows: list[dict[str, Any]], swept: Sequence[str],
          value: Callable[[dict[str, Any]], float | None] | None = None,
          caption: str = "seconds per mini-batch (median of the timed iterations)",
          digits: int = 4) -> str:
    """A figure per point (default: seconds per mini-batch), a column per value
    of the first swept setting and a row per combination of the others."""
    def seconds(row: dict[str, Any]) -> float | None:
        return float(row["seconds_per_batch"])

    value = value or seconds
    first = swept[0]
    columns = list(dict.fromkeys(row[first] for row in rows))
    others = [key for key in dict.fromkeys(("framework", "model", *swept[1:])) if key != first]
    if "batch_size" not in swept:
        others.append("batch_size")
    groups: dict[tuple[Any, ...], dict[Any, float | None]] = {}
    for row in rows:
        key = tuple(row[k] for k in others)
        groups.setdefault(key, {})[row[first]] = value(row)
    header = [*others, *(f"{first}={column}" for column in columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, figures in groups.items():
        cells = [str(k) for k in key] + [
            "-" if figures.get(column) is None else f"{figures[column]:.{digits}f}"
            for column in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\n{caption}\n"


def tables(rows: list[dict[str, Any]], swept: Sequence[str]) -> str:
    """Time per mini-batch as in Shi et al.'s Table 7, then the CPU figures beside it."""
    prefix, whose = cpu_columns(rows)

    def system_share(row: dict[str, Any]) -> float | None:
        user, system = (row.get(f"{prefix}cpu_{mode}_seconds_per_batch")
                        for mode in ("user", "system"))
        if user is None or system is None or user + system <= 0:
            return None
        return float(system / (user + system))

    def involuntary(row: dict[str, Any]) -> float | None:
        figure = row.get(f"{prefix}involuntary_switches_per_batch")
        return None if figure is None else float(figure)

    def spread(row: dict[str, Any]) -> float | None:
        if "seconds_per_batch_max" not in row:
            return None
        return float((row["seconds_per_batch_max"] - row["seconds_per_batch_min"])
                     / row["seconds_per_batch"])

    repeats = rows[0].get("repeats") if rows else None
    noise = (table(rows, swept, spread, f"spread of the time per mini-batch over {repeats} "
                   "interleaved repeats, (max - min) / median: differences smaller than "
                   "this are noise", 2),) if repeats else ()
    return "\n".join((
        table(rows, swept, caption="seconds per mini-batch (median of the timed iterations"
              + (f", then of {repeats} repeats)" if repeats else ")")),
        *noise,
        table(rows, swept, system_share, f"system share of CPU time ({whose})", 3),
        table(rows, swept, involuntary,
              f"involuntary context switches per mini-batch ({whose})", 1)))


MAX_PLOTTED_GROUPS = 8


def plot(rows: list[dict[str, Any]], swept: str, path: Path) -> bool:
    """A row of panels per framework, model and other setting: time per
    mini-batch against the swept setting, the CPU split by mode, and involuntary
    context switches. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    prefix, whose = cpu_columns(rows)
    varying = [key for key in rows[0] if key not in (swept, "seconds_per_batch")
               and key in PARAMETERS and len({str(row.get(key)) for row in rows}) > 1]
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        title = f"{row['framework']} {row['model']}, batch {row['batch_size']}" + "".join(
            f", {key} {row[key]}" for key in varying if key not in ("framework", "model"))
        groups.setdefault(title, []).append(row)
    shown = list(groups.items())[:MAX_PLOTTED_GROUPS]
    figure, axes = plt.subplots(len(shown), 3, figsize=(14, 3.4 * len(shown)), squeeze=False)
    for (title, group), (left, middle, right) in zip(shown, axes, strict=True):
        labels = [str(row[swept]) for row in group]
        positions = list(range(len(group)))
        left.plot(labels, [row["seconds_per_batch"] * 1000 for row in group], marker="o")
        left.set(xlabel=swept, ylabel="ms per mini-batch", title=title)
        left.set_ylim(bottom=0)
        user = [(row.get(f"{prefix}cpu_user_seconds_per_batch") or 0) * 1000 for row in group]
        system = [(row.get(f"{prefix}cpu_system_seconds_per_batch") or 0) * 1000
                  for row in group]
        middle.bar(positions, user, label="user")
        middle.bar(positions, system, bottom=user, label="system")
        middle.set_xticks(positions, labels)
        middle.set(xlabel=swept, ylabel="CPU ms per mini-batch",
                   title=f"CPU by mode ({whose})")
        middle.legend()
        right.bar(positions, [row.get(f"{prefix}involuntary_switches_per_batch") or 0
                              for row in group], color="tab:red")
        right.set_xticks(positions, labels)
        right.set(xlabel=swept, ylabel="per mini-batch", title="involuntary context switches")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return True


def write_results(rows: list[dict[str, Any]], swept: Sequence[str], out: Path) -> list[Path]:
    import csv

    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "results.csv", out / "table.md"]
    written[0].write_text(json.dumps(rows, indent=2) + "\n")
    with written[1].open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    written[2].write_text(tables(rows, swept))
    if plot(rows, swept[0], out / "plot.png"):
        written.append(out / "plot.png")
    return written


def default_out_dir() -> Path:
    return Path(os.getcwd()) / time.strftime("sweep-%Y%m%d-%H%M%S")
