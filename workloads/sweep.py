"""Runs a reference workload over a grid of settings, each point in a fresh
process (thread pools can be sized only once per process), and writes what it
measured: results as CSV and JSON, a table laid out like Shi et al.'s Table 7
(time per mini-batch, one column per value of the swept setting), and plots.

Beside each point's time it records the run's CPU seconds in user and system
mode and its context switches over the timed iterations: the papers' sign of
oversubscription is system time and involuntary switches rising with the
thread count."""

from __future__ import annotations

import csv
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
    return {**point, **measured, "wall_seconds": wall}


def table(rows: list[dict[str, Any]], swept: Sequence[str]) -> str:
    """Seconds per mini-batch, a column per value of the first swept setting and
    a row per combination of the others."""
    first = swept[0]
    columns = list(dict.fromkeys(row[first] for row in rows))
    keys = ("framework", "model")
    others = [*swept[1:], *(["batch_size"] if "batch_size" not in swept else [])]
    groups: dict[tuple[Any, ...], dict[Any, float]] = {}
    for row in rows:
        key = tuple(row[k] for k in (*keys, *others))
        groups.setdefault(key, {})[row[first]] = row["seconds_per_batch"]
    header = ["framework", "model", *others, *(f"{first}={value}" for value in columns)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, times in groups.items():
        cells = [str(k) for k in key] + [
            f"{times[value]:.4f}" if value in times else "-" for value in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nseconds per mini-batch (median of the timed iterations)\n"


def plot(rows: list[dict[str, Any]], swept: str, path: Path) -> bool:
    """Time per mini-batch against the swept setting, with the CPU split and the
    involuntary context switches beside it. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [str(row[swept]) for row in rows]
    positions = range(len(rows))
    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 4))
    left.plot(labels, [row["seconds_per_batch"] * 1000 for row in rows], marker="o")
    left.set(xlabel=swept, ylabel="ms per mini-batch", title="time per mini-batch")
    user = [row["cpu_user_seconds_per_batch"] * 1000 for row in rows]
    system = [row["cpu_system_seconds_per_batch"] * 1000 for row in rows]
    middle.bar(positions, user, label="user")
    middle.bar(positions, system, bottom=user, label="system")
    middle.set_xticks(list(positions), labels)
    middle.set(xlabel=swept, ylabel="CPU ms per mini-batch", title="CPU by mode")
    middle.legend()
    right.bar(positions, [row["involuntary_switches_per_batch"] for row in rows])
    right.set_xticks(list(positions), labels)
    right.set(xlabel=swept, ylabel="per mini-batch", title="involuntary context switches")
    first = rows[0]
    figure.suptitle(f"{first['framework']} {first['model']}, batch {first['batch_size']}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def write_results(rows: list[dict[str, Any]], swept: Sequence[str], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "results.json", out / "results.csv", out / "table.md"]
    written[0].write_text(json.dumps(rows, indent=2) + "\n")
    with written[1].open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    written[2].write_text(table(rows, swept))
    if plot(rows, swept[0], out / "plot.png"):
        written.append(out / "plot.png")
    return written


def default_out_dir() -> Path:
    return Path(os.getcwd()) / time.strftime("sweep-%Y%m%d-%H%M%S")
