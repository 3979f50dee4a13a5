"""The benchmark harness works: each benchmark runs in --smoke mode and writes a
result with the expected structure and finite figures. Speed is never asserted:
these are figures for people, produced by full runs on a quiet machine."""

from __future__ import annotations

import datetime
import json
import math
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.common import (
    Column,
    Result,
    Table,
    fit_line,
    median_interval,
    percentile,
    rerun_command,
)
from benchmarks.common import render_markdown as markdown
from tests.conftest import REPO, agent_env
from tests.helpers import wait_until

TOP_LEVEL = {"benchmark", "title", "what", "smoke", "date", "duration_seconds", "command",
             "machine", "settings", "noise", "figures", "targets", "tables", "unavailable",
             "owed", "notes"}
MACHINE = {"cores", "cpu_model", "kernel", "python", "torch", "tensorflow"}
# Figures that are a time, a size or a rate: positive whatever the machine's noise.
POSITIVE = {
    "overhead": (".step_seconds",),
    "footprint": (".peak_rss_bytes",),
    "scrape": (".payload_bytes", ".render_seconds", "_seconds"),
    "probe": ("recorder.", "poll."),
    "scaling": (".per_interval_seconds",),
    "launch": (".start_seconds",),
    "top": ("_seconds",),
}


def run_smoke(name: str, out: Path) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-m", "benchmarks.run", name, "--smoke",
                             "--out", str(out)], cwd=REPO, env=agent_env(),
                            capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[" in result.stderr, "no progress on stderr"
    data: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    return data


@pytest.mark.slow  # runs each benchmark on real jobs
@pytest.mark.parametrize("name", list(POSITIVE))
def test_smoke_run_writes_a_complete_result(name: str, tmp_path: Path) -> None:
    data = run_smoke(name, tmp_path)
    assert set(data) >= TOP_LEVEL
    assert data["benchmark"] == name and data["smoke"] is True
    assert set(data["machine"]) >= MACHINE and data["machine"]["cores"] >= 1
    assert data["command"].startswith(f"python -m benchmarks.run {name} --smoke")
    assert str(tmp_path) not in data["command"], "the command must not name this machine's paths"
    assert data["noise"]["summary"]
    assert data["tables"], "no table"
    for table in data["tables"]:
        keys = {column["key"] for column in table["columns"]}
        assert table["rows"], f"table {table['name']} is empty"
        for row in table["rows"]:
            assert set(row) <= keys, (table["name"], set(row) - keys)
    assert data["figures"]
    for key, value in data["figures"].items():
        assert isinstance(value, int | float) and math.isfinite(value), (key, value)
        if any(part in key for part in POSITIVE[name]) and "slowdown" not in key:
            assert value > 0, (key, value)
    for target in data["targets"]:
        assert target["met"] in (True, False, None) and target["target"] and target["measured"]
    text = (tmp_path / f"{name}.md").read_text()
    assert "Smoke run" in text and data["command"] in text and "**Noise**" in text


def test_help_names_every_benchmark_and_its_targets() -> None:
    result = subprocess.run([sys.executable, "-m", "benchmarks.run", "--help"], cwd=REPO,
                            env=agent_env(), capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stderr
    for name in (*POSITIVE, "all"):
        assert f"  {name}" in result.stdout
    assert "targets" in result.stdout and "p99 <= 10 ms" in result.stdout
    detail = subprocess.run([sys.executable, "-m", "benchmarks.run", "overhead", "--help"],
                            cwd=REPO, env=agent_env(), capture_output=True, text=True,
                            timeout=60, check=False)
    assert "0.5%" in detail.stdout and "--smoke" in detail.stdout


def test_rerun_command_names_no_path_of_this_machine(tmp_path: Path) -> None:
    inside = REPO / "docs" / "results"
    assert rerun_command(["scrape", "--out", str(inside)], inside, inside) == (
        "python -m benchmarks.run scrape")
    assert rerun_command(["scrape", f"--out={tmp_path}"], tmp_path, inside) == (
        "python -m benchmarks.run scrape --out DIR")
    assert rerun_command(["scrape", "--out", str(REPO / "x")], REPO / "x", inside) == (
        "python -m benchmarks.run scrape --out x")


def test_statistics() -> None:
    fit = fit_line([1, 2, 3, 4], [3, 5, 7, 9])
    assert fit.slope == pytest.approx(2) and fit.intercept == pytest.approx(1)
    assert fit.r2 == pytest.approx(1) and fit.solve(11) == pytest.approx(5)
    assert percentile([1, 2, 3, 4, 5], 50) == 3
    assert percentile(list(range(101)), 99) == pytest.approx(99)


def test_markdown_marks_targets_and_missing_values() -> None:
    result = Result("x", "X", "What.", smoke=False, settings={"rounds": 5},
                    tables=[Table("t", "T", [Column("a", "A", "ms"),
                                             Column("ok", "verdict", "met")],
                                  rows=[{"a": 0.0015, "ok": False}, {"a": None}])])
    data = result.as_dict("python -m benchmarks.run x", datetime.datetime.now(), 1.0)
    text = markdown(result, data)
    assert "| 1.50 ms | **missed** |" in text and "| - | - |" in text
    assert "Smoke run" not in text


def test_the_median_interval_covers_the_median_and_narrows_with_more_rounds() -> None:
    rng = random.Random(1)
    few = [0.5 + rng.gauss(0, 1) for _ in range(10)]
    many = [0.5 + rng.gauss(0, 1) for _ in range(400)]
    median, low, high = median_interval(few)
    assert low <= median <= high and (median, low, high) == median_interval(few)
    _, many_low, many_high = median_interval(many)
    assert many_low < 0.5 < many_high and many_high - many_low < high - low
    assert median_interval([2.0]) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError):
        median_interval([])


def test_has_exited_leaves_a_tracees_stop_to_its_tracer() -> None:
    """A benchmark's agent injects from the job's own parent, where a Popen.poll() on
    another thread used to take the injector's ptrace stop as the job's exit."""
    import os
    import signal

    from benchmarks.common import has_exited
    from dlprof_agent.reach.tracer import PTRACE_DETACH, WALL, Tracer

    ptrace_attach = 16
    # Attached once it runs: attached mid-exec, its first stop would be the exec's
    # SIGTRAP, not the attach's SIGSTOP.
    job = subprocess.Popen([sys.executable, "-c", "print('ready', flush=True); "
                            "import time; time.sleep(60)"], text=True, stdout=subprocess.PIPE)
    assert job.stdout is not None and job.stdout.readline() == "ready\n"
    ptrace = Tracer()
    try:
        try:
            ptrace(ptrace_attach, job.pid)
        except OSError as error:
            pytest.skip(f"this machine refuses ptrace: {error}")
        wait_until(lambda: os.waitid(os.P_PID, job.pid, os.WEXITED | os.WNOHANG
                                     | os.WNOWAIT), timeout=10)
        assert not has_exited(job)
        waited, status = os.waitpid(job.pid, WALL | os.WNOHANG)
        assert waited == job.pid and os.WIFSTOPPED(status), "the tracer's stop was taken"
        assert os.WSTOPSIG(status) == signal.SIGSTOP  # which PTRACE_ATTACH sends
        ptrace(PTRACE_DETACH, job.pid)
        assert not has_exited(job)
        job.kill()
        wait_until(lambda: has_exited(job), timeout=10)
        assert job.returncode == -signal.SIGKILL
    finally:
        job.stdout.close()
        if job.returncode is None:
            job.kill()
            job.wait()
