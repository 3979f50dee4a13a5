"""`workload sweep`: the tables and plots it writes, and sweeps whose points run
under the agent, recording what the agent saw from outside each job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dlprof_agent.workloads import sweep
from tests.conftest import REPO, agent_env


def row(framework: str, threads: int, seconds: float,
        agent: tuple[float, float, float]) -> dict[str, Any]:
    """A result row; ``agent``: user and system CPU and involuntary switches per batch."""
    user, system, involuntary = agent
    return {"framework": framework, "model": "lstm", "batch_size": 32, "threads": threads,
            "seconds_per_batch": seconds, "cpu_user_seconds_per_batch": 2 * user,
            "cpu_system_seconds_per_batch": 0.0, "involuntary_switches_per_batch": 0.0,
            "agent_cpu_user_seconds_per_batch": user,
            "agent_cpu_system_seconds_per_batch": system,
            "agent_involuntary_switches_per_batch": involuntary}


ROWS = [row("pytorch", 1, 0.10, (0.09, 0.01, 1.0)), row("pytorch", 2, 0.06, (0.10, 0.02, 3.0)),
        row("tensorflow", 1, 0.20, (0.18, 0.02, 2.0)),
        row("tensorflow", 2, 0.12, (0.20, 0.05, 40.0))]


def test_the_tables_put_one_row_per_framework_and_a_column_per_swept_value() -> None:
    text = sweep.tables(ROWS, ["threads"])
    assert "| framework | model | batch_size | threads=1 | threads=2 |" in text
    assert "| pytorch | lstm | 32 | 0.1000 | 0.0600 |" in text
    # the agent's CPU, not the run's own: system / (user + system)
    assert "| tensorflow | lstm | 32 | 0.100 | 0.200 |" in text
    assert "system share of CPU time (seen by the agent)" in text
    assert "| tensorflow | lstm | 32 | 2.0 | 40.0 |" in text


def test_without_the_agent_the_tables_use_the_runs_own_rusage() -> None:
    rows = [{**r, "agent_cpu_user_seconds_per_batch": None} for r in ROWS]
    text = sweep.tables(rows, ["threads"])
    assert "(the run's own rusage)" in text
    assert "| pytorch | lstm | 32 | 0.000 | 0.000 |" in text


@pytest.mark.slow  # imports matplotlib: seconds
def test_the_plot_has_a_row_of_panels_per_framework(tmp_path: Path) -> None:
    import matplotlib.image

    assert sweep.plot(ROWS, "threads", tmp_path / "plot.png")
    one = tmp_path / "one.png"
    assert sweep.plot(ROWS[:2], "threads", one)
    two_rows = matplotlib.image.imread(tmp_path / "plot.png")
    one_row = matplotlib.image.imread(one)
    assert two_rows.shape[1] == one_row.shape[1]
    assert two_rows.shape[0] > 1.8 * one_row.shape[0]


def test_framework_and_model_can_be_swept() -> None:
    assert sweep.parse_param("framework=PyTorch,tensorflow") == (
        "framework", ["pytorch", "tensorflow"])
    assert sweep.grid([("model", ["lstm", "resnet-56"]), ("threads", [1, 2])])[1] == {
        "model": "lstm", "threads": 2}


@pytest.mark.slow  # real training jobs under the agent
def test_a_sweep_under_the_agent_records_what_the_agent_saw(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    result = subprocess.run(
        [sys.executable, "-m", "dlprof_agent", "workload", "sweep", "--attach",
         "--interval", "0.1", "--model", "small-cnn", "--batch-size", "8", "--iterations",
         "100", "--warmup", "3", "--param", "threads=1,2", "--out", str(out)],
        cwd=REPO, env=agent_env(), capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    rows = json.loads((out / "results.json").read_text())
    assert [r["threads"] for r in rows] == [1, 2]
    for point in rows:
        # The agent saw the steady steps, from outside, as the job's own clock did.
        assert point["agent_steps"] >= 20
        own, seen = point["mean_seconds_per_batch"], point["agent_seconds_per_batch"]
        assert 0.7 < seen / own < 1.4, (seen, own)
        ratio = (point["agent_cpu_user_seconds_per_batch"]
                 / point["cpu_user_seconds_per_batch"])
        assert 0.5 < ratio < 2.0, point
        assert point["agent_involuntary_switches_per_batch"] >= 0
        assert point["agent_peak_threads"] >= 1
    table = (out / "table.md").read_text()
    assert "(seen by the agent)" in table
    assert (out / "plot.png").read_bytes().startswith(b"\x89PNG")


def test_repeats_are_combined_into_medians_with_the_spread() -> None:
    runs = [{"threads": 2, "framework": "pytorch", "batch_size": 32, "seconds_per_batch": t,
             "agent_cpu_user_seconds_per_batch": t / 2, "agent_steps": None}
            for t in (0.30, 0.10, 0.20)]
    row = sweep.combine_repeats(runs)
    assert row["seconds_per_batch"] == 0.20 and row["agent_cpu_user_seconds_per_batch"] == 0.10
    assert (row["seconds_per_batch_min"], row["seconds_per_batch_max"]) == (0.10, 0.30)
    assert row["repeats"] == 3
    assert row["threads"] == 2 and row["batch_size"] == 32 and row["agent_steps"] is None
