"""DLPROF_PROBE=1: the sleeping probe at interpreter start, with no code change
and no ptrace. A wheel of this checkout is built and installed into a
throwaway virtual environment (so the .pth is where pip really puts it), and a
torchrun job launched there with the variable is found and read by a daemon
started with --no-inject: steps, the step's split and the job's identity. A job
without the variable is untouched, and a job's own sitecustomize still runs
beside the probe, whether the probe comes from site-packages or from the copy
an init container makes (`probe-copy`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from dlprof_agent.collectors.procfs import read_status
from tests.conftest import OWN_JOBS, REPO, agent_env, free_port, http_get, wait_for

pytestmark = pytest.mark.slow

JOB_ID = "launch-probe"
# What the job prints: whether a probe thread runs, whether any of our modules
# were imported, and whether the job's own sitecustomize ran.
REPORT = ("import os, sys, threading; print(sorted(t.name for t in threading.enumerate()), "
          "any(m.startswith('dlprof_agent') for m in sys.modules), "
          "os.environ.get('OWN_SITE', 'no'))")


@pytest.fixture(scope="module")
def launch_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment with this checkout installed from its wheel, and the
    test environment's packages (torch) visible through a path line."""
    root = tmp_path_factory.mktemp("launch")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".mypy_cache",
        ".ruff_cache", ".pytest_cache", "docs", "tests"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(root / "dist"), str(source)],
                   check=True, timeout=300, cwd=root)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    (wheel,) = (root / "dist").glob("*.whl")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, timeout=300)
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print("
                                   "sysconfig.get_paths()['purelib'])"], check=True,
                                  capture_output=True, text=True, timeout=60).stdout.strip())
    assert (purelib / "dlprof_agent_probe.pth").is_file(), "pip did not install the .pth"
    (purelib / "test_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def report(python: Path | str, env: dict[str, str]) -> str:
    return subprocess.run([str(python), "-c", REPORT], env=env, cwd=REPO, check=True,
                          capture_output=True, text=True, timeout=60).stdout.strip()


def bare_env(**extra: str) -> dict[str, str]:
    """The environment without this checkout on PYTHONPATH: only what the test names."""
    env = {name: value for name, value in os.environ.items()
           if name not in ("PYTHONPATH", "DLPROF_PROBE")}
    return {**env, **extra}


def test_unset_the_installed_hook_imports_nothing(launch_python: Path) -> None:
    assert report(launch_python, bare_env()) == "['MainThread'] False no"
    assert report(launch_python, bare_env(DLPROF_PROBE="0")) == "['MainThread'] False no"


def test_set_the_installed_hook_starts_one_sleeping_thread(launch_python: Path) -> None:
    assert report(launch_python, bare_env(DLPROF_PROBE="1")) == (
        "['MainThread', 'dlprof-probe'] True no")


@pytest.fixture
def own_site(tmp_path: Path) -> Path:
    """The job's own sitecustomize, which must still run."""
    folder = tmp_path / "own"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITE'] = 'yes'\n")
    return folder


def test_the_jobs_own_sitecustomize_runs_beside_the_installed_probe(
        launch_python: Path, own_site: Path) -> None:
    assert report(launch_python, bare_env(DLPROF_PROBE="1", PYTHONPATH=str(own_site))) == (
        "['MainThread', 'dlprof-probe'] True yes")


def test_a_copied_probe_starts_with_the_variable_and_chains_the_jobs_sitecustomize(
        tmp_path: Path, own_site: Path) -> None:
    """An image without the package: the init container's copy on PYTHONPATH."""
    copy = tmp_path / "copy"
    subprocess.run([sys.executable, "-m", "dlprof_agent", "probe-copy", str(copy)],
                   env=agent_env(), check=True, capture_output=True, timeout=60)
    path = os.pathsep.join([str(copy), str(own_site)])
    # A bare interpreter: the base Python, not one that has the package installed.
    python = shutil.which("python3") or sys.executable
    assert report(python, bare_env(PYTHONPATH=path)) == "['MainThread'] False yes"
    assert report(python, bare_env(PYTHONPATH=path, DLPROF_PROBE="1")) == (
        "['MainThread', 'dlprof-probe'] True yes")


def scrape(port: int) -> str:
    return http_get(f"http://127.0.0.1:{port}/metrics").decode()


def start_daemon(processes: list[subprocess.Popen[bytes]]) -> int:
    port = free_port()
    processes.append(subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent", "daemon", "--port", str(port), "--quiet",
         "--no-gpu", "--no-inject", "--interval", "0.5", "--scan-interval", "0.5",
         *OWN_JOBS],
        cwd=REPO, env=agent_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    return port


def test_a_job_launched_with_the_variable_is_read_by_a_daemon_that_never_injects(
        launch_python: Path, tmp_path: Path, processes: list[subprocess.Popen[bytes]]
        ) -> None:
    """And when that daemon stops, the probe goes back to sleep: the next daemon
    reads the job as the first did."""
    port = start_daemon(processes)
    env = {**agent_env(), "DLPROF_PROBE": "1", "OMP_NUM_THREADS": "1"}
    processes.append(subprocess.Popen(
        [str(launch_python), "-m", "torch.distributed.run", "--nnodes", "1",
         "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
         str(free_port()), "--rdzv-id", JOB_ID, "tests/jobs/torch_ddp.py",
         "--step-log", str(tmp_path / "steps"), "--until", str(tmp_path / "stop")],
        cwd=REPO, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE))
    # Neither the daemon nor the job calls enable(): the rank's probe came at launch.
    split = re.compile(r'dlprof_step_phase_seconds_total\{[^}]*job_id="' + JOB_ID
                       + r'"[^}]*phase="forward"[^}]*\} [1-9e.]')

    def read(port: int) -> str | None:
        text = scrape(port)
        steps = re.search(r'dlprof_steps_total\{[^}]*job_id="' + JOB_ID
                          + r'"[^}]*rank="0"[^}]*\} ([0-9.e+]+)', text)
        return text if steps and float(steps.group(1)) > 0 and split.search(text) else None

    wait_for(lambda: read(port), "the rank's steps and their split on /metrics", 240)
    first = processes[0]
    first.terminate()
    first.wait(30)
    second = start_daemon(processes)
    wait_for(lambda: read(second), "the next daemon to read the same rank", 120)
    (tmp_path / "stop").touch()


def test_a_job_without_the_variable_is_left_alone_by_a_daemon_that_never_injects(
        launch_python: Path, processes: list[subprocess.Popen[bytes]]) -> None:
    port = free_port()
    processes.append(subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent", "daemon", "--port", str(port), "--quiet",
         "--no-gpu", "--no-inject", "--interval", "0.5", "--scan-interval", "0.5",
         "--match", "launch-probe-untouched", *OWN_JOBS],
        cwd=REPO, env=agent_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    job = subprocess.Popen(
        [str(launch_python), "-c", "import threading, time, sys\n"
         "# launch-probe-untouched\nwhile True:\n"
         "    print(sorted(t.name for t in threading.enumerate()), flush=True)\n"
         "    sys.stdin.readline()\n"],
        env=bare_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    processes.append(job)  # type: ignore[arg-type]
    assert job.stdin is not None and job.stdout is not None
    assert job.stdout.readline().strip() == "['MainThread']"
    # The daemon watches it (its command line matches) from outside, and no more.
    wait_for(lambda: f'pid="{job.pid}"' in scrape(port), "the daemon to watch the job", 60)
    job.stdin.write("\n")
    job.stdin.flush()
    assert job.stdout.readline().strip() == "['MainThread']"


def test_a_probe_no_agent_reaches_stays_asleep(launch_python: Path) -> None:
    """A process that is no training job pays one thread that does not wake:
    over a few seconds its probe thread is not scheduled again."""
    job = subprocess.Popen(
        [str(launch_python), "-c", "import sys, threading\n"
         "print(*[t.native_id for t in threading.enumerate() if t.name == 'dlprof-probe'], "
         "flush=True)\nsys.stdin.read()\n"],
        env=bare_env(DLPROF_PROBE="1"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    try:
        assert job.stdout is not None
        tid = int(job.stdout.readline())

        def switches() -> int:
            status = read_status(job.pid, tid=tid)
            assert status is not None and status.voluntary_context_switches is not None
            return status.voluntary_context_switches

        wait_for(lambda: read_status(job.pid, tid=tid) is not None, "the probe thread")
        first, since = switches(), time.monotonic()
        while time.monotonic() - since < 3.0:  # a window, not a deadline: more is fine
            time.sleep(0.5)
        assert switches() - first <= 1  # it woke at most once in the window
    finally:
        job.kill()
        job.wait(10)
