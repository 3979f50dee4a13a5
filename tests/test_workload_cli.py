"""`dlprof-agent workload list`: every reference model, built in each framework,
with the same trainable-parameter count in both."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dlprof_agent.workloads.models import MODELS
from tests.conftest import agent_env

pytest.importorskip("torch")
pytest.importorskip("tensorflow")


def workload(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dlprof_agent", "workload", *args],
                          env=agent_env(), capture_output=True, text=True, timeout=300,
                          check=False)


def test_list_gives_both_frameworks_counts_and_they_agree() -> None:
    result = workload("list", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [row["name"] for row in rows] == list(MODELS)
    for row in rows:
        assert row["pytorch"] == row["tensorflow"], row["name"]
        assert row["pytorch"] > 0
    counts = {row["name"]: row["pytorch"] for row in rows}
    assert counts["resnet-50"] == 25_557_032  # the well-known figure
    assert counts["small-cnn"] == 136_874


def test_list_prints_a_table_with_the_papers_figures() -> None:
    result = workload("list")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["model", "input", "paper", "pytorch", "tensorflow", "same"]
    alexnet = next(line for line in lines if line.startswith("alexnet-s "))
    assert "~61M" in alexnet and "62.38M" in alexnet and alexnet.endswith("yes")


def test_no_action_is_a_one_line_error() -> None:
    result = workload()
    assert result.returncode == 2
    assert result.stderr.startswith("dlprof-agent: error: no workload action given")
    assert len(result.stderr.splitlines()) == 1


def run_json(*args: str) -> dict[str, object]:
    result = workload("run", "--scale", "tiny", "--iterations", "3", "--warmup", "1", "--json",
                      *args)
    assert result.returncode == 0, result.stderr
    answer: dict[str, object] = json.loads(result.stdout)
    return answer


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_run_measures_time_per_mini_batch(framework: str) -> None:
    result = run_json("--framework", framework, "--model", "alexnet-r", "--threads", "1")
    seconds = result["seconds_per_batch"]
    assert isinstance(seconds, float) and seconds > 0
    assert result["samples_per_second"] == pytest.approx(2 / seconds)
    assert result["batch_size"] == 2
    assert result["parameters"] == 89_578
    assert isinstance(result["peak_rss_bytes"], int) and result["peak_rss_bytes"] > 50 << 20
    assert result["layout"] == ("NCHW" if framework == "pytorch" else "NHWC")


def test_run_takes_the_papers_levers() -> None:
    result = run_json("--model", "lstm", "--precision", "amp", "--input-grad")
    assert result["precision"] == "amp" and result["model"] == "lstm"
    result = run_json("--model", "small-cnn", "--layout", "NHWC", "--batch-size", "4")
    assert result["layout"] == "NHWC" and result["batch_size"] == 4


@pytest.mark.parametrize(("args", "says"), [
    (["--device", "cuda"], "no CUDA GPU is available to pytorch here"),
    (["--iterations", "0"], "--iterations"),
    (["--model", "vgg"], "--model"),
    (["--warmup", "-1"], "--warmup"),
])
def test_run_bad_input_is_a_one_line_error(args: list[str], says: str) -> None:
    result = workload("run", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dlprof-agent: error:")
    assert says in lines[0]
