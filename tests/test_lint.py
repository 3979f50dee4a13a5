"""The code stays typed and lint-clean, and installs as one import package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(args: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600,
                          check=False)


def test_ruff_is_clean() -> None:
    if shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists():
        pytest.fail("ruff is not installed: pip install '.[test]'")
    result = run([sys.executable, "-m", "ruff", "check", "."])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow  # strict mypy over the package, its tests and torch's stubs: a minute
def test_mypy_strict_is_clean() -> None:
    result = run([sys.executable, "-m", "mypy"])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow  # builds a wheel
def test_wheel_holds_only_the_dlprof_agent_package(tmp_path: Path) -> None:
    result = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "-q", "-w", str(tmp_path), str(REPO)])
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("dlprof_agent-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    # The package, and the one-line .pth that DLPROF_PROBE=1 needs at the top of
    # site-packages (setup.py): nothing else that could shadow a user's module.
    assert {t for t in top_level if not t.endswith(".dist-info")} == {
        "dlprof_agent", "dlprof_agent_probe.pth"}
    hook = zipfile.ZipFile(wheel).read("dlprof_agent_probe.pth")
    assert hook == (REPO / "dlprof_agent/probe/preload/dlprof_agent_probe.pth").read_bytes()
    for module in ("cli/main.py", "collectors/process.py", "collectors/nvml.py",
                   "exporters/prometheus.py", "workloads/busy.py", "py.typed",
                   "grafana/dashboards/overview.json"):
        assert f"dlprof_agent/{module}" in names
    assert not any("/tests/" in name or name.startswith("tests/") for name in names)
