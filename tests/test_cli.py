"""The command line, run as a real subprocess the way a user runs it."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import agent_env
from tests.helpers import SCRAPE_TIMEOUT_SECONDS, wait_until

REPO_ROOT = Path(__file__).resolve().parents[1]
NO_SUCH_PID = 4_194_000  # above every default pid_max; checked before use
ERROR_PREFIX = "dlprof-agent: error:"


def agent(*args: str, prefix: tuple[str, ...] = (),
          timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, sys.executable, "-m", "dlprof_agent", *args],
                          env=agent_env(), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, check=False)


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The error contract: one line on stderr, the exit code for the kind of error."""
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(ERROR_PREFIX), lines[0]
    assert result.returncode == code, result.stderr
    assert result.stdout == ""
    return lines[0]


@pytest.fixture
def spawn() -> Iterator[Callable[[list[str]], subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(args: list[str]) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   start_new_session=True)
        started.append(process)
        return process

    yield start
    for process in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


@pytest.fixture
def target(spawn: Callable[[list[str]], subprocess.Popen[bytes]]) -> int:
    """A live process of our own user to attach to."""
    return spawn(["sleep", "60"]).pid


# --- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "code", "says"), [
    (["attach", str(NO_SUCH_PID)], 3, f"no process with pid {NO_SUCH_PID}"),
    (["snapshot", str(NO_SUCH_PID)], 3, f"no process with pid {NO_SUCH_PID}"),
    (["attach", "0"], 2, "pid"),
    (["attach", "-5"], 2, "pid"),
    (["attach", "abc"], 2, "'abc' is not a pid"),
    (["snapshot", "abc"], 2, "'abc' is not a pid"),
    (["attach", "{pid}", "--interval", "0"], 2, "--interval"),
    (["attach", "{pid}", "--interval", "-1"], 2, "--interval"),
    (["attach", "{pid}", "--interval", "fast"], 2, "'fast' is not a number of seconds"),
    (["attach", "{pid}", "--interval", "nan"], 2, "--interval"),
    (["attach", "{pid}", "--interval", "inf"], 2, "--interval"),
    (["attach", "{pid}", "--duration", "0"], 2, "--duration"),
    (["attach", "{pid}", "--port", "70000"], 2, "--port"),
    (["attach", "{pid}", "--port", "http"], 2, "--port"),
    (["attach", "{pid}", "--listen", "192.0.2.1", "--port", "0"], 2, "cannot listen on"),
    (["attach", "{pid}", "--listen", "not.an.address.invalid", "--port", "0"], 2,
     "cannot listen on"),
    (["attach", "{pid}", "--bogus"], 2, "--bogus"),
    (["frobnicate"], 2, "frobnicate"),
    (["attach", "{pid}", "--node-name", ""], 2, "'' is not a node name"),
    (["daemon", "--node-name", "gpu\tnode"], 2, "is not a node name"),
    (["attach", "{pid}", "--warmup-steps", "-1"], 2, "--warmup-steps"),
    (["attach", "{pid}", "--warmup-steps", "ten"], 2, "'ten' is not a number of steps"),
    (["run"], 2, "no command to run"),
    (["run", "--"], 2, "no command to run"),
    (["run", "--port", "0", "--", "/no/such/trainer"], 2, "cannot start '/no/such/trainer'"),
], ids=lambda value: " ".join(value) if isinstance(value, list) else None)
def test_bad_input_is_one_line_and_an_exit_code(args: list[str], code: int, says: str,
                                                target: int) -> None:
    assert not os.path.exists(f"/proc/{NO_SUCH_PID}")
    result = agent(*(arg.replace("{pid}", str(target)) for arg in args))
    line = assert_one_line_error(result, code)
    assert says in line


def test_a_zombie_target_is_no_target(
        spawn: Callable[[list[str]], subprocess.Popen[bytes]]) -> None:
    zombie = spawn(["sleep", "60"])
    os.kill(zombie.pid, signal.SIGKILL)  # not reaped yet
    wait_until(lambda: psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE, 10,
               what="a zombie")
    line = assert_one_line_error(agent("attach", str(zombie.pid)), 3)
    assert "has exited" in line


def test_a_port_in_use_is_exit_5(target: int) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = agent("attach", str(target), "--port", str(port), "--duration", "1",
                       "--quiet")
    line = assert_one_line_error(result, 5)
    assert f"port {port} on 127.0.0.1 is already in use" in line


def test_run_on_a_port_in_use_is_exit_5_and_never_starts_the_job(tmp_path: Path) -> None:
    started = tmp_path / "started"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = agent("run", "--port", str(port), "--quiet", "--", sys.executable, "-c",
                       f"open({str(started)!r}, 'w')")
    line = assert_one_line_error(result, 5)
    assert f"port {port} on 127.0.0.1 is already in use" in line
    assert not started.exists(), "the job was started, then stopped for the agent's port"


def test_another_users_process_without_cap_sys_ptrace_is_exit_4(
        spawn: Callable[[list[str]], subprocess.Popen[bytes]]) -> None:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed")
    if os.geteuid() != 0:
        pytest.skip("needs root, to start a target as another user")
    nobody = spawn([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups",
                    "sleep", "60"])
    wait_until(lambda: psutil.Process(nobody.pid).uids().real == 65534
               and psutil.Process(nobody.pid).name() == "sleep", 10,
               what="the target to run as nobody")
    no_ptrace = (setpriv, "--bounding-set", "-sys_ptrace", "--inh-caps", "-sys_ptrace")
    probe = subprocess.run(
        [*no_ptrace, sys.executable, "-c", f"open('/proc/{nobody.pid}/io').read()"],
        capture_output=True, text=True, timeout=30, check=False)
    if probe.stderr.startswith("setpriv:"):
        pytest.skip(f"cannot drop CAP_SYS_PTRACE here: {probe.stderr.strip()}")
    if "PermissionError" not in probe.stderr:
        pytest.skip("this kernel lets root without CAP_SYS_PTRACE read another user's "
                    "/proc/<pid>/io, so there is no permission error to report")

    result = agent("attach", str(nobody.pid), "--port", "0", "--duration", "1", "--quiet",
                   prefix=no_ptrace)

    line = assert_one_line_error(result, 4)
    assert f"no permission to read process {nobody.pid}" in line
    assert "CAP_SYS_PTRACE" in line  # the hint says what to do


# --- what works --------------------------------------------------------------------


@pytest.mark.parametrize("command", [[], ["attach"], ["snapshot"], ["demo"], ["trace"]],
                         ids=["top", "attach", "snapshot", "demo", "trace"])
def test_help_exits_0_with_examples(command: list[str]) -> None:
    result = agent(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "example" in result.stdout
    assert "exit codes" in result.stdout or command == ["demo"]
    assert result.stderr == ""


def test_version() -> None:
    result = agent("--version")
    assert result.returncode == 0
    assert re.fullmatch(r"dlprof-agent \d+\.\d+\.\d+\S*\n", result.stdout)


def test_snapshot_prints_the_exposition(target: int) -> None:
    result = agent("snapshot", str(target))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert f'dlprof_process_threads{{pid="{target}"}} 1.0' in result.stdout
    assert f'dlprof_target_up{{pid="{target}"}} 1.0' in result.stdout
    assert f'dlprof_process_cpu_seconds_total{{mode="user",pid="{target}"}}' in result.stdout
    assert "dlprof_gpu_available" in result.stdout
    assert "nan" not in result.stdout.lower()


def test_snapshot_passes_promtool_check_metrics(target: int) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not on PATH")
    exposition = agent("snapshot", str(target)).stdout
    assert exposition
    check = subprocess.run([promtool, "check", "metrics"], input=exposition,
                           capture_output=True, text=True, timeout=30, check=False)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.slow  # a real agent for a timing window of seconds
def test_attach_serves_metrics_until_the_duration(target: int) -> None:
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent", "attach", str(target), "--port", "0",
         "--duration", "2", "--quiet", "--interval", "0.2"],
        env=agent_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None and process.stdout is not None
        url = None
        for line in process.stderr:
            assert "Traceback" not in line
            found = re.search(r"serving (http://\S+)/metrics", line)
            if found:
                url = found.group(1)
                break
        assert url is not None, "the agent never said where it serves"
        with urllib.request.urlopen(f"{url}/metrics", timeout=SCRAPE_TIMEOUT_SECONDS) as response:
            text = response.read().decode()
        assert f'dlprof_target_up{{pid="{target}"}} 1.0' in text
        assert f'dlprof_process_threads{{pid="{target}"}} 1.0' in text
        with urllib.request.urlopen(f"{url}/healthz", timeout=SCRAPE_TIMEOUT_SECONDS) as response:
            assert response.status == 200

        stdout, stderr = process.communicate(timeout=15)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert stdout == ""  # --quiet: no summary
    assert time.monotonic() - started < 10


@pytest.mark.slow  # a real agent for a timing window of seconds
@pytest.mark.serial  # the target lives 2 s: the agent must have attached by then
def test_attach_ends_soon_after_the_target_exits(
        spawn: Callable[[list[str]], subprocess.Popen[bytes]]) -> None:
    short = spawn(["sleep", "2"])
    started = time.monotonic()
    result = agent("attach", str(short.pid), "--port", "0", "--grace", "1",
                   "--interval", "0.2", timeout=20)
    elapsed = time.monotonic() - started

    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert elapsed < 7
    assert f"summary for pid {short.pid} (the process exited)" in result.stdout
    assert "\r" not in result.stdout  # a pipe gets no live status line
    assert f"process {short.pid} exited" in result.stderr
