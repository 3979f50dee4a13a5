"""End to end with real parts: a busy multi-threaded process, the agent attached to
it, and a real Prometheus server scraping the agent, queried over its HTTP API."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


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


def proc_cpu_seconds(pid: int) -> tuple[float, float]:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


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


def test_prometheus_scrapes_cpu_and_threads_that_match_procfs(
        busy: subprocess.Popen[bytes], agent: tuple[subprocess.Popen[bytes], int],
        prometheus: Prometheus) -> None:
    pid = busy.pid
    selector = f'pid="{pid}"'
    wait_for(lambda: prometheus.query(f"dlprof_process_threads{{{selector}}}"),
             "the first scrape to land in Prometheus")

    # Freeze the target so the agent's sample, Prometheus's scrape and our own
    # /proc read all see the same moment.
    os.kill(pid, signal.SIGSTOP)
    time.sleep(3.0)  # one sampling interval plus a scrape interval, with room
    user, system = proc_cpu_seconds(pid)
    scraped_user = prometheus.value(
        f'dlprof_process_cpu_seconds_total{{{selector},mode="user"}}')
    scraped_system = prometheus.value(
        f'dlprof_process_cpu_seconds_total{{{selector},mode="system"}}')
    assert user > 1.0, "the busy process should have used CPU by now"
    assert scraped_user == pytest.approx(user, rel=0.02)
    assert scraped_user + scraped_system == pytest.approx(user + system, rel=0.02)

    threads = len(os.listdir(f"/proc/{pid}/task"))
    assert prometheus.value(f"dlprof_process_threads{{{selector}}}") == threads
    groups = prometheus.query(f"dlprof_thread_group_threads{{{selector}}}")
    assert {g["metric"]["thread_name"] for g in groups} >= {"busy-0", "busy-1", "busy-2"}
    assert sum(float(g["value"][1]) for g in groups) == threads

    busy_cpu = prometheus.value(
        f'sum(dlprof_thread_group_cpu_seconds_total{{{selector},thread_name=~"busy-.*",'
        f'mode="user"}})')
    assert 0.5 * user < busy_cpu <= user * 1.02, "the hashing threads did the work"
    assert prometheus.value(f"dlprof_target_up{{{selector}}}") == 1
    assert prometheus.value('dlprof_host_cpus{kind="logical"}') == os.cpu_count()
    assert prometheus.query("dlprof_gpu_available")


def test_rates_over_time_show_the_cores_in_use(
        busy: subprocess.Popen[bytes], agent: tuple[subprocess.Popen[bytes], int],
        prometheus: Prometheus) -> None:
    selector = f'pid="{busy.pid}"'
    query = f'sum(rate(dlprof_process_cpu_seconds_total{{{selector},mode!="iowait"}}[4s]))'
    cores = wait_for(lambda: prometheus.query(query), "a rate over four scrapes", 20)
    # Three hashing threads compete with Prometheus and the agent for this
    # machine's cores: a good share of one core, and never more than all of them.
    assert 0.25 <= float(cores[0]["value"][1]) <= (os.cpu_count() or 1) + 0.2


def test_exposition_passes_promtool(agent: tuple[subprocess.Popen[bytes], int]) -> None:
    if PROMTOOL is None:
        pytest.fail("promtool is not installed (Debian package `prometheus`)")
    exposition = http_get(f"http://127.0.0.1:{agent[1]}/metrics")
    check = subprocess.run([PROMTOOL, "check", "metrics"], input=exposition,
                           capture_output=True, timeout=30, check=False)
    assert check.returncode == 0 and check.stdout == b"" and check.stderr == b"", check


def test_target_exit_is_scraped_as_down_then_agent_exits_zero(
        busy: subprocess.Popen[bytes], agent: tuple[subprocess.Popen[bytes], int],
        prometheus: Prometheus) -> None:
    selector = f'pid="{busy.pid}"'
    wait_for(lambda: prometheus.query(f"dlprof_target_up{{{selector}}} == 1"), "target up")
    busy.kill()
    busy.wait()
    wait_for(lambda: prometheus.query(f"dlprof_target_up{{{selector}}} == 0"),
             "Prometheus to see the target down", 10)
    # Gone from the scrape, so Prometheus marks them stale rather than repeating them.
    wait_for(lambda: not prometheus.query(f"dlprof_process_threads{{{selector}}}"),
             "the exited process's series to go stale", 5)
    agent_process, _ = agent
    assert agent_process.wait(15) == 0
