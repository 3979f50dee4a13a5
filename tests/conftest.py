"""Shared fixtures for the end-to-end tests: a busy multi-threaded process, the
agent attached to it, and a real Prometheus server scraping the agent."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


@functools.cache
def agent_env() -> dict[str, str]:
    """The environment, plus this checkout on PYTHONPATH unless it is importable already."""
    env = dict(os.environ)
    probe = subprocess.run(
        [sys.executable, "-c", "import dlprof_agent; print(dlprof_agent.__file__)"],
        env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=30,
        check=False)
    found = Path(probe.stdout.strip()).resolve().parent if probe.returncode == 0 else None
    if found != REPO / "dlprof_agent":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO),
                                                          env.get("PYTHONPATH")]))
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = condition()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def http_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        return bytes(response.read())


def spawn(args: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(10)


class Prometheus:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def query(self, promql: str) -> list[dict[str, Any]]:
        body = http_get(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        answer = json.loads(body)
        assert answer["status"] == "success", answer
        return list(answer["data"]["result"])

    def value(self, promql: str) -> float:
        result = self.query(promql)
        assert len(result) == 1, (promql, result)
        return float(result[0]["value"][1])


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[Any]]]:
    """Processes a test starts. At its end each one still there is killed, with its
    process group when it leads one (started in a session of its own), after a
    SIGCONT should the test have stopped it; then it is reaped and its pipes closed."""
    started: list[subprocess.Popen[Any]] = []
    yield started
    for process in started:
        if process.returncode is None:  # not reaped yet: its pid is still its own
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # none unless it leads a group
            if process.poll() is None:
                process.kill()
        process.wait(10)
        for pipe in (process.stdin, process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def busy() -> Iterator[subprocess.Popen[bytes]]:
    process = spawn([sys.executable, "-m", "dlprof_agent.workloads.busy", "--threads", "3"])
    assert process.stdout is not None
    process.stdout.readline()  # it prints once its threads run
    yield process
    if process.poll() is None:
        os.kill(process.pid, signal.SIGCONT)
    stop(process)


@pytest.fixture
def agent(busy: subprocess.Popen[bytes]) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    process = spawn([sys.executable, "-m", "dlprof_agent", "attach", str(busy.pid),
                     "--port", str(port), "--interval", "0.5", "--grace", "4", "--quiet"])
    wait_for(lambda: http_get(f"http://127.0.0.1:{port}/healthz"), "the agent's /healthz")
    yield process, port
    stop(process)


@pytest.fixture
def prometheus(tmp_path: Path, agent: tuple[subprocess.Popen[bytes], int]
               ) -> Iterator[Prometheus]:
    if PROMETHEUS is None:
        pytest.fail("the prometheus server is not installed (Debian package `prometheus`)")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: dlprof\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{agent[1]}']}}]\n")
    port = free_port()
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Prometheus(port)
    wait_for(lambda: http_get(f"{server.url}/-/ready"), "Prometheus to be ready")
    yield server
    process.terminate()
    process.wait(10)
