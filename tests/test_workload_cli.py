"""`dlprof-agent workload list`: every reference model, built in each framework,
with the same trainable-parameter count in both."""

from __future__ import annotations

import csv
import gzip
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
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


def test_sweep_writes_results_a_table_and_a_plot(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    result = workload("sweep", "--model", "alexnet-r", "--scale", "tiny", "--iterations", "2",
                      "--warmup", "1", "--param", "threads=1,2", "--out", str(out))
    assert result.returncode == 0, result.stderr
    rows = json.loads((out / "results.json").read_text())
    assert [row["threads"] for row in rows] == [1, 2]
    for row in rows:
        assert row["seconds_per_batch"] > 0
        assert row["cpu_user_seconds_per_batch"] > 0
        assert row["involuntary_switches_per_batch"] >= 0
    with (out / "results.csv").open() as file:
        assert len(list(csv.DictReader(file))) == 2
    table = (out / "table.md").read_text()
    assert "| framework | model | batch_size | threads=1 | threads=2 |" in table
    assert (out / "plot.png").read_bytes().startswith(b"\x89PNG")
    assert table in result.stdout


def test_sweep_bad_param_is_a_one_line_error(tmp_path: Path) -> None:
    result = workload("sweep", "--param", "colour=red", "--out", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.startswith("dlprof-agent: error: cannot sweep 'colour'")
    assert len(result.stderr.splitlines()) == 1


def write_cifar(directory: Path, records: int) -> None:
    rng = np.random.default_rng(0)
    data = np.concatenate([rng.integers(0, 10, (records, 1)),
                           rng.integers(0, 256, (records, 3072))], axis=1).astype(np.uint8)
    directory.mkdir()
    (directory / "data_batch_1.bin").write_bytes(data.tobytes())


def write_mnist(directory: Path, count: int) -> None:
    rng = np.random.default_rng(0)
    directory.mkdir()
    images = rng.integers(0, 256, (count, 28, 28)).astype(np.uint8)
    labels = rng.integers(0, 10, count).astype(np.uint8)
    with gzip.open(directory / "train-images-idx3-ubyte.gz", "wb") as file:
        file.write(struct.pack(">IIII", 0x803, count, 28, 28) + images.tobytes())
    (directory / "train-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, count)
                                                        + labels.tobytes())


@pytest.mark.parametrize("framework", ["pytorch", "tensorflow"])
def test_run_trains_on_real_dataset_files(framework: str, tmp_path: Path) -> None:
    write_cifar(tmp_path / "cifar", 10)
    write_mnist(tmp_path / "mnist", 12)
    cifar = run_json("--framework", framework, "--model", "small-cnn",
                     "--data", str(tmp_path / "cifar"), "--batch-size", "4")
    assert cifar["data"] == str(tmp_path / "cifar") and cifar["batch_size"] == 4
    mnist = run_json("--framework", framework, "--model", "fcn-r",
                     "--data", str(tmp_path / "mnist"), "--batch-size", "5")
    assert isinstance(mnist["seconds_per_batch"], float) and mnist["seconds_per_batch"] > 0


@pytest.mark.parametrize(("model", "says"), [
    ("fcn-r", "cannot use the data"),
    ("resnet-50", "trains on synthetic data only"),
])
def test_run_with_unusable_data_is_a_one_line_error(tmp_path: Path, model: str,
                                                    says: str) -> None:
    result = workload("run", "--model", model, "--scale", "tiny", "--data", str(tmp_path))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and says in lines[0]


def test_data_parallel_reports_compute_and_gradient_exchange_per_rank() -> None:
    result = run_json("--model", "alexnet-r", "--ranks", "2", "--threads", "1")
    ranks = result["per_rank"]
    assert isinstance(ranks, list) and [rank["rank"] for rank in ranks] == [0, 1]
    assert len({rank["pid"] for rank in ranks}) == 2
    for rank in ranks:
        assert rank["compute_seconds_per_batch"] > 0
        assert rank["exchange_seconds_per_batch"] > 0
    assert result["gradient_bytes"] == 89_578 * 4  # float32 gradients, all of them
    assert result["global_batch_size"] == 4


def test_tensorflow_data_parallel_reports_compute_and_gradient_exchange_per_rank() -> None:
    result = run_json("--framework", "tensorflow", "--model", "alexnet-r", "--ranks", "2",
                      "--threads", "1")
    ranks = result["per_rank"]
    assert isinstance(ranks, list) and [rank["rank"] for rank in ranks] == [0, 1]
    assert len({rank["pid"] for rank in ranks}) == 2
    for rank in ranks:
        assert rank["compute_seconds_per_batch"] > 0
        assert rank["exchange_seconds_per_batch"] > 0
    assert result["global_batch_size"] == 2 * result["batch_size"] == 4  # type: ignore[operator]
    from dlprof_agent.workloads import keras_models

    single_process = keras_models.trainable_parameters(keras_models.build("alexnet-r"))
    assert result["parameters"] == single_process
    assert result["gradient_bytes"] == single_process * 4  # float32 gradients, all of them


def test_run_under_the_agent_prints_the_workloads_and_the_agents_figures() -> None:
    result = workload("run", "--model", "small-cnn", "--batch-size", "8", "--iterations", "40",
                      "--warmup", "2", "--threads", "1", "--attach")
    assert result.returncode == 0, result.stderr
    assert "time per mini-batch" in result.stdout  # the workload's own
    assert "dlprof-agent summary for pid" in result.stdout  # the agent's
    steps = next(line for line in result.stdout.splitlines() if line.strip().startswith("steps"))
    assert "steady" in steps
    assert "lost the probe" not in result.stderr  # the job ending is not a loss
