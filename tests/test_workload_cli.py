"""`dlprof-agent workload list`: every reference model, built in each framework,
with the same trainable-parameter count in both."""

from __future__ import annotations

import csv
import functools
import gzip
import json
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dlprof_agent.cli.main import build_parser
from dlprof_agent.cli.workload_run import refusal
from dlprof_agent.workloads.models import MODELS
from tests.conftest import agent_env

pytest.importorskip("torch")
pytest.importorskip("tensorflow")
pytestmark = pytest.mark.slow  # it imports torch and TensorFlow


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


@functools.cache
def bf16_lstm_missing() -> str:
    """Why this CPU cannot train an LSTM in bfloat16, or "" if it can: oneDNN has the
    primitive only with AVX512-BF16 or AMX (an AMD EPYC without them refuses it)."""
    import torch

    lstm = torch.nn.LSTM(4, 4, batch_first=True)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output, _ = lstm(torch.randn(2, 3, 4))
        output.float().sum().backward()
    except RuntimeError as error:
        return str(error).strip().splitlines()[0][:200]
    return ""


def test_run_takes_the_papers_levers() -> None:
    result = run_json("--model", "small-cnn", "--layout", "NHWC", "--batch-size", "4")
    assert result["layout"] == "NHWC" and result["batch_size"] == 4


def test_run_trains_an_lstm_in_bfloat16_where_the_cpu_can() -> None:
    if why := bf16_lstm_missing():
        pytest.skip(f"this CPU's oneDNN has no bfloat16 LSTM ({why})")
    result = run_json("--model", "lstm", "--precision", "amp", "--input-grad")
    assert result["precision"] == "amp" and result["model"] == "lstm"


def test_amp_on_a_cpu_without_bfloat16_kernels_names_the_setting() -> None:
    if not bf16_lstm_missing():
        pytest.skip("this CPU trains an LSTM in bfloat16: nothing is refused")
    result = workload("run", "--scale", "tiny", "--iterations", "1", "--warmup", "0",
                      "--model", "lstm", "--precision", "amp")
    assert result.returncode == 2
    assert result.stderr == (
        "dlprof-agent: error: pytorch cannot train lstm with --precision amp on this CPU: its "
        "oneDNN has no bfloat16 kernel for it here: use --precision fp32 (the default)\n")


def test_a_refusal_names_the_settings_that_caused_it() -> None:
    """What oneDNN says on a CPU without AVX512-BF16 or AMX (an AMD EPYC), and what the
    user is told instead."""
    parser = build_parser()
    onednn = RuntimeError("could not create a primitive descriptor for an LSTM forward "
                          "propagation primitive")
    args = parser.parse_args(["workload", "run", "--model", "lstm", "--precision", "amp"])
    assert refusal(args, onednn).one_line() == (
        "pytorch cannot train lstm with --precision amp on this CPU: its oneDNN has no "
        "bfloat16 kernel for it here: use --precision fp32 (the default)")
    args = parser.parse_args(["workload", "run", "--framework", "tensorflow", "--layout",
                              "NCHW", "--input-grad"])
    conv = ValueError("The Conv2D op currently only supports the NHWC tensor format on the "
                      "CPU.\nThe op was given the format: NCHW")
    assert refusal(args, conv).one_line() == (
        "tensorflow cannot train small-cnn with --layout NCHW --input-grad on cpu: The Conv2D "
        "op currently only supports the NHWC tensor format on the CPU.: change those "
        "settings (see --help)")


def test_run_help_explains_every_option() -> None:
    lines = workload("run", "--help").stdout.splitlines()
    explained, bare = set(), []
    for index, line in enumerate(lines):
        if not line.startswith("  -"):
            continue
        invocation, *help_text = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        name = invocation.split()[0].rstrip(",")
        follows = index + 1 < len(lines) and re.match(r" {20,}\S", lines[index + 1])
        (explained.add(name) if help_text or follows else bare.append(name))
    assert {"--framework", "--model", "--device", "--inter-op-threads"} <= explained
    assert bare == []


def test_sweep_help_lists_every_param_name() -> None:
    from dlprof_agent.workloads.sweep import PARAMETERS

    result = workload("sweep", "--help")
    text = " ".join(result.stdout.split())
    listed = re.search(r"a setting and its values: ([a-z_, ]+);", text)
    assert listed is not None
    assert listed.group(1).split(", ") == list(PARAMETERS)


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


def test_run_under_the_agent_counts_every_step_of_a_short_run() -> None:
    """The agent samples every --interval: a run of a fraction of a second must wait
    for the probe's hooks before its first step, and for a last read after its last."""
    result = workload("run", "--model", "small-cnn", "--scale", "tiny", "--iterations", "50",
                      "--warmup", "10", "--threads", "1", "--attach", "--json")
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout)["agent"]["probe"]
    assert probe["warmup_steps"] == 10
    # A step is the time between two step boundaries: 60 steps close 59 of them.
    assert probe["steady_steps"] == 49
