"""scripts/gpu-check where there is no GPU: it checks nothing, says so plainly,
and ends in seconds; bad options get a one-line error."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, agent_env

SCRIPT = REPO / "scripts" / "gpu-check"


def gpu_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=agent_env(),
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="this machine has a GPU driver")
def test_without_a_gpu_it_checks_nothing_says_so_and_ends_in_seconds(tmp_path: Path) -> None:
    started = time.monotonic()
    result = gpu_check("--out", str(tmp_path))
    assert time.monotonic() - started < 30
    assert result.returncode == 0, result.stderr
    summary = (tmp_path / "README.md").read_text()
    assert result.stdout == summary
    assert "**No NVIDIA GPU here: nothing was checked on a GPU.**" in summary
    reason = "no NVIDIA GPU here (no /dev/nvidiactl or nvidia-smi sees none)"
    for step in ("environment", "wheels", "gpu tests", "overhead", "flush cost", "sweeps"):
        assert f"| {step} | skipped | 0 | {reason} |" in summary
        assert f"- {step}: {reason}" in summary  # said plainly, step by step
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md"]


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="this machine has a GPU driver")
def test_without_a_gpu_and_without_out_nothing_is_written() -> None:
    before = set((REPO / "docs").rglob("*"))
    result = gpu_check()
    assert result.returncode == 0
    assert "nothing was checked on a GPU" in result.stdout
    assert set((REPO / "docs").rglob("*")) == before


def test_bad_options_get_a_one_line_error(tmp_path: Path) -> None:
    result = gpu_check("--wheels", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"gpu-check: error: --wheels {tmp_path / 'missing'}: not a folder"]


def test_help_says_what_it_proves_and_how_to_run_it() -> None:
    result = gpu_check("--help")
    assert result.returncode == 0
    for words in ("no network", "9 minutes", "--wheels DIR", "docs/evidence/<date>-<gpu>/",
                  "pip --no-index"):
        assert words in result.stdout.replace("\n", " ").replace("  ", " ") or \
            words in result.stdout, words


def load_script() -> Any:
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel, as pip installs it."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}/__init__.py", f"VERSION = {version!r}\n")
        archive.writestr(f"{info}/METADATA",
                         f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                         "Root-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return path


def test_wheels_brought_along_go_into_a_folder_of_their_own_without_a_cupti(
        tmp_path: Path) -> None:
    script = load_script()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel(wheels, "cupti_python_stand_in", "13.0.1")
    wheel(wheels, "nvidia_cuda_cupti", "13.4.0")  # would shadow the framework's CUPTI
    check = script.Check(tmp_path, 120)
    target = tmp_path / "site"

    result, notes = script.install_wheels(check, wheels, 60, target)

    assert result == "ok", notes
    assert notes == ("1 wheel(s) into site; left out, to keep the framework's own: "
                     "nvidia_cuda_cupti-13.4.0-py3-none-any.whl")
    assert (target / "cupti_python_stand_in" / "__init__.py").exists()
    assert not (target / "nvidia_cuda_cupti").exists()
    assert check.env["PYTHONPATH"].split(os.pathsep)[0] == str(target)
    assert (tmp_path / "wheels.txt").exists()  # pip's output, kept with the evidence


def test_the_flush_cost_snippet_and_the_sweeps_arguments_are_valid() -> None:
    script = load_script()
    compile(script.FLUSH_COST, "flush-cost", "exec")
    help_text = subprocess.run([sys.executable, "-m", "dlprof_agent", "workload", "sweep",
                                "--help"], env=agent_env(), capture_output=True, text=True,
                               timeout=60, check=True).stdout
    for option in ("--device", "--cudnn-autotune", "--attach", "--iterations", "--warmup"):
        assert option in help_text


@pytest.mark.e2e
def test_the_overhead_step_runs_the_benchmarks_paired_method_on_a_cpu_job(
        tmp_path: Path) -> None:
    """The overhead step on the same harness with a CPU job (small CNN): its figures
    mean nothing here; its table must be whole and its verdict read from it."""
    pytest.importorskip("torch")
    script = load_script()
    check = script.Check(tmp_path, 400)
    check.env = agent_env() | {"OMP_NUM_THREADS": "1"}

    result, notes = script.overhead(check, 300, (
        "--workloads", "pytorch:small-cnn", "--cnn-batch", "8", "--pairs", "2",
        "--block-seconds", "0.05", "--smoke"))

    assert result in ("ok", "failed") and "--layers" in notes and "overhead.md" in notes, notes
    table = (tmp_path / "overhead.md").read_text()
    assert "median of pairs [95% interval]" in table
    for label in ("nothing (off against off)", "probe: step timing with the split",
                  "probe: --layers", "framework profiler"):
        assert f"| {label}" in table, label
    assert "CUDA kernels" not in table  # without a GPU there is no kernel tracing to price
