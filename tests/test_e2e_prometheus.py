"""End to end with real parts: a busy multi-threaded process, the agent attached to
it, and a real Prometheus server scraping the agent, queried over its HTTP API."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import PROMTOOL, Prometheus, http_get, wait_for

pytestmark = pytest.mark.e2e

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def proc_cpu_seconds(pid: int) -> tuple[float, float]:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


def agent_passes(port: int) -> float:
    for line in http_get(f"http://127.0.0.1:{port}/metrics").decode().splitlines():
        if line.startswith("dlprof_agent_samples_total "):
            return float(line.split()[1])
    raise AssertionError("the agent exports no dlprof_agent_samples_total")


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
    # Passes so far: the last may have read before the stop, the one after it did not.
    passes = agent_passes(agent[1])
    # No series yet, or for a moment none: a scrape that a loaded machine made late.
    wait_for(lambda: any(float(r["value"][1]) >= passes + 2
                         for r in prometheus.query("dlprof_agent_samples_total")),
             "Prometheus to scrape a pass that began after the stop")
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


@pytest.mark.serial  # the cores the job gets: other tests would take them
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
