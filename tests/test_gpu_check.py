"""scripts/gpu-check where there is no GPU: it checks nothing, says so plainly,
and ends in seconds; bad options get a one-line error."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

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
