"""The probe at launch: what DLPROF_PROBE and its .pth cost every Python start.

A wheel of this checkout is built and installed into two throwaway virtual
environments, the same but for the `dlprof_agent_probe.pth` that pip puts in
site-packages (removed from the second). The interpreter's start, from spawn
to exit of `python -c pass`, is timed in interleaved ABBA rounds: with the .pth
present and DLPROF_PROBE unset against no .pth at all (what every Python
process of a fleet pays when the variable is off), and with the variable set
against unset (the sleeping probe's import and thread). The same for `python -c
"import torch"`, fewer rounds, when torch is installed. Each round gives one
difference (the mean of its two B runs less the mean of its two A runs); the
result is their median with a 95% bootstrap interval.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO,
    Column,
    HostBusy,
    Option,
    Progress,
    Result,
    Table,
    TargetCheck,
    load_average,
    median_interval,
    positive_int,
)

NAME = "launch"
TITLE = "The probe at launch"
SUMMARY = ("the interpreter's start time with the launch .pth and DLPROF_PROBE unset "
           "against no .pth, and with the variable set (paired ABBA rounds)")
TARGETS = ("with DLPROF_PROBE unset, the .pth adds under 1 ms to `python -c pass` (the 95% "
           "interval's upper end)")
UNSET_TARGET_SECONDS = 0.001
MEASURES = ("dlprof_agent/probe", "setup.py", "benchmarks/launch.py")
HOOK = "dlprof_agent_probe.pth"

OPTIONS = (
    Option("--rounds", 400, 10, "ABBA rounds of `python -c pass` per comparison",
           positive_int, "N"),
    Option("--torch-rounds", 5, 0, "ABBA rounds of `python -c 'import torch'` (0: none)",
           int, "N"),
)

# (name, what is compared, A's condition, B's condition)
COMPARISONS = (
    ("unset", ".pth present, DLPROF_PROBE unset, against no .pth", "absent", "unset"),
    ("set", "DLPROF_PROBE=1 against unset (the sleeping probe)", "unset", "set"),
)


def _environments(root: Path) -> dict[str, Path]:
    """The Python of each environment: "with" the .pth, "without" it."""
    source = root / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".mypy_cache",
        ".ruff_cache", ".pytest_cache", "docs", "tests"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(root / "dist"), str(source)],
                   check=True, timeout=600, cwd=root, stdout=subprocess.DEVNULL,
                   env=_bare_env())
    (wheel,) = (root / "dist").glob("*.whl")
    pythons = {}
    for name in ("with", "without"):
        venv = root / name
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)],
                       check=True, timeout=120)
        python = venv / "bin" / "python"
        subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                        "-q", "--no-deps", "--no-index", str(wheel)], check=True, timeout=300,
                       env=_bare_env())
        purelib = Path(subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True, timeout=60,
            env=_bare_env()).stdout.strip())
        # The benchmark's own packages (torch), seen the same way from both.
        (purelib / "benchmark_packages.pth").write_text(
            sysconfig.get_paths()["purelib"] + "\n")
        if name == "without":
            (purelib / HOOK).unlink()
        elif not (purelib / HOOK).is_file():
            raise RuntimeError(f"pip did not install {HOOK}")
        pythons[name] = python
    return pythons


def _bare_env() -> dict[str, str]:
    """The caller's environment less what would load a checkout or the probe: the
    environments must see only their own wheel."""
    return {name: value for name, value in os.environ.items()
            if name not in ("DLPROF_PROBE", "PYTHONPATH")}


def _start_seconds(python: Path, code: str, probe: bool) -> float:
    env = _bare_env()
    if probe:
        env["DLPROF_PROBE"] = "1"
    started = time.perf_counter()
    subprocess.run([str(python), "-c", code], env=env, check=True, timeout=120,
                   stdout=subprocess.DEVNULL, cwd=tempfile.gettempdir())
    return time.perf_counter() - started


def _condition(pythons: dict[str, Path], name: str) -> tuple[Path, bool]:
    return {"absent": (pythons["without"], False), "unset": (pythons["with"], False),
            "set": (pythons["with"], True)}[name]


def _rounds(pythons: dict[str, Path], code: str, a: str, b: str, rounds: int
            ) -> tuple[list[float], list[float]]:
    """Per round, B's mean less A's, and every A time."""
    differences: list[float] = []
    a_times: list[float] = []
    first, second = _condition(pythons, a), _condition(pythons, b)
    _start_seconds(first[0], code, first[1])  # warm the file cache for both
    _start_seconds(second[0], code, second[1])
    for _ in range(rounds):
        a1 = _start_seconds(first[0], code, first[1])
        b1 = _start_seconds(second[0], code, second[1])
        b2 = _start_seconds(second[0], code, second[1])
        a2 = _start_seconds(first[0], code, first[1])
        differences.append((b1 + b2 - a1 - a2) / 2)
        a_times.extend((a1, a2))
    return differences, a_times


def _torch_installed() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def run(settings: dict[str, Any]) -> Result:
    result = Result(NAME, TITLE, (__doc__ or "").split("\n\n", 1)[1].replace("\n", " ").strip(),
                    settings["smoke"], settings)
    rounds = int(settings["rounds"])
    torch_rounds = int(settings["torch_rounds"]) if _torch_installed() else 0
    if int(settings["torch_rounds"]) and not torch_rounds:
        result.unavailable.append("`import torch`: torch is not installed")
    programs = [("pass", "pass", rounds)]
    if torch_rounds:
        programs.append(("torch", "import torch", torch_rounds))
    progress = Progress(NAME, len(programs) * len(COMPARISONS))
    table = Table("start", "The interpreter's start, spawn to exit", [
        Column("program", "python -c"), Column("comparison", "comparison"),
        Column("rounds", "ABBA rounds", "int"), Column("base", "A's median", "ms"),
        Column("difference", "median difference", "ms"),
        Column("low", "95% interval, low", "ms"), Column("high", "high", "ms")])
    busy = HostBusy()
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="dlprof-launch-") as root:
        pythons = _environments(Path(root))
        busy.start()
        for program, code, count in programs:
            for name, words, a, b in COMPARISONS:
                differences, a_times = _rounds(pythons, code, a, b, count)
                progress.advance(f"python -c {code!r}: {words}")
                median, low, high = median_interval(differences)
                table.rows.append({"program": program, "comparison": words, "rounds": count,
                                   "base": statistics.median(a_times), "difference": median,
                                   "low": low, "high": high})
                result.figures[f"{program}.{a}.start_seconds"] = statistics.median(a_times)
                result.figures[f"{program}.{name}.difference_seconds"] = median
                result.figures[f"{program}.{name}.low_seconds"] = low
                result.figures[f"{program}.{name}.high_seconds"] = high
        busy.stop()
    result.tables.append(table)
    high = result.figures["pass.unset.high_seconds"]
    result.targets.append(TargetCheck(
        "unset", "the .pth with DLPROF_PROBE unset adds under 1 ms to `python -c pass`",
        f"{result.figures['pass.unset.difference_seconds'] * 1000:+.2f} ms, 95% interval up "
        f"to {high * 1000:+.2f} ms", high < UNSET_TARGET_SECONDS))
    result.noise.update(host_busy_share=busy.shares[0], load_before=load_before,
                        load_after=load_average())
    result.noise_summary = (
        f"the machine was {busy.shares[0]:.0%} busy while measuring (these starts "
        f"included); load average {load_before[0]:.2f} before, {load_average()[0]:.2f} after")
    result.resolution = (
        "the width of each 95% interval: a difference inside it cannot be told from none")
    result.notes.append(
        "Each start is a fresh process: fork, exec, the interpreter's start and exit, "
        "timed from the parent. Both environments hold the same wheel and the same path "
        "line to the benchmark's own packages; only the .pth differs.")
    return result
