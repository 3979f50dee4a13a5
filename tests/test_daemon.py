"""`dlprof-agent daemon`: finds jobs started after it, reads each under its own
pid on one endpoint, and forgets each once it has exited and its grace is over."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dlprof_agent.agent.discovery import DaemonOptions, Discovery
from dlprof_agent.exporters.prometheus import NodeCollector
from dlprof_agent.model.snapshot import NodeSnapshot
from tests.conftest import OWN_JOBS, REPO, agent_env, free_port, http_get, wait_for
from tests.full_snapshot import full_snapshot

JOB = str(REPO / "tests" / "jobs" / "torch_cnn.py")
INTERVAL = 0.25
GRACE = 10.0  # how long an exited job shows down: wide enough for a loaded machine's scrapes


def series_of(pid: int, exposition: str) -> list[str]:
    return [line for line in exposition.splitlines()
            if not line.startswith("#") and f'pid="{pid}"' in line]


def value(exposition: str, name: str, pid: int, extra: str = "") -> float | None:
    pattern = re.compile(rf'^{name}{{(?=[^}}]*pid="{pid}")(?=[^}}]*{extra})[^}}]*}} (\S+)$',
                         re.MULTILINE)
    found = [float(v) for v in pattern.findall(exposition)]
    return sum(found) if found else None


@pytest.fixture
def runtime_dir(tmp_path: Path) -> Path:
    """A probe runtime dir of this test's own, for the daemon and the jobs."""
    directory = tmp_path / "run"
    directory.mkdir(mode=0o700)
    return directory


@pytest.fixture
def daemon(runtime_dir: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    port = free_port()
    env = {**agent_env(), "DLPROF_AGENT_RUNTIME_DIR": str(runtime_dir)}
    process = subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent", "daemon", "--port", str(port), "--interval",
         str(INTERVAL), "--scan-interval", str(INTERVAL), "--match", r"job-b\.log",
         "--no-gpu", "--warmup-steps", "2", "--grace", str(GRACE), *OWN_JOBS],
        cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: http_get(f"http://127.0.0.1:{port}/healthz"), "the daemon's /healthz")
    yield process, port
    if process.poll() is None:
        process.kill()
    process.wait(10)


def test_the_daemon_watches_jobs_started_after_it_and_drops_each_after_its_grace(
        daemon: tuple[subprocess.Popen[str], int], runtime_dir: Path, tmp_path: Path,
        processes: list[subprocess.Popen[bytes]]) -> None:
    agent, port = daemon

    def scrape() -> str:
        return http_get(f"http://127.0.0.1:{port}/metrics").decode()

    assert not series_of(os.getpid(), scrape())
    env = {**agent_env(), "DLPROF_AGENT_RUNTIME_DIR": str(runtime_dir)}
    stop_a, stop_b = tmp_path / "stop-a", tmp_path / "stop-b"
    # A loads the probe itself (found by its socket); B is found by --match and
    # gets the probe injected.
    job_a = subprocess.Popen([sys.executable, JOB, "--enable-probe", "--steps", "100000",
                              "--log", str(tmp_path / "job-a.log"), "--until", str(stop_a)],
                             cwd=REPO, env=env)
    job_b = subprocess.Popen([sys.executable, JOB, "--steps", "100000",
                              "--log", str(tmp_path / "job-b.log"), "--until", str(stop_b)],
                             cwd=REPO, env=env)
    processes += [job_a, job_b]

    def both_training() -> str | None:
        text = scrape()
        steps = [value(text, "dlprof_steps_total", job.pid) for job in (job_a, job_b)]
        # Findings are judged once a job has a window of samples (a few seconds).
        judged = [value(text, "dlprof_finding", job.pid, 'finding="memory_near_limit"')
                  is not None for job in (job_a, job_b)]
        return text if all(s and s > 5 for s in steps) and all(judged) else None

    text = wait_for(both_training, "steps of both jobs on the daemon's endpoint", 90)
    for job in (job_a, job_b):
        assert value(text, "dlprof_target_up", job.pid) == 1
        assert value(text, "dlprof_probe_up", job.pid) == 1
        assert value(text, "dlprof_process_cpu_seconds_total", job.pid, 'mode="user"')
        # Each job's findings, judged on its own window: memory is far from any limit.
        assert value(text, "dlprof_finding", job.pid, 'finding="memory_near_limit"') == 0
    # Valid exposition: each family once, whatever the number of jobs.
    names = [family.name for family in text_string_to_metric_families(text)]
    assert len(names) == len(set(names))

    stop_a.touch()
    assert job_a.wait(30) == 0
    # Through the grace: down, with the probe's final totals (every step A logged
    # but the first, which only opens the first timed step).
    text = wait_for(lambda: (t := scrape()) and value(t, "dlprof_target_up", job_a.pid) == 0
                    and t, "A's exit on the endpoint", GRACE)
    logged = (tmp_path / "job-a.log").read_text().count('"step"')
    assert 0 < (value(text, "dlprof_steps_total", job_a.pid) or 0) <= logged - 1
    assert value(text, "dlprof_probe_up", job_a.pid) == 0
    assert value(text, "dlprof_process_cpu_seconds_total", job_a.pid) is None
    wait_for(lambda: series_of(job_a.pid, scrape()) == [], "A's series gone after the grace",
             GRACE + 10)
    assert value(scrape(), "dlprof_steps_total", job_b.pid)  # B is still read

    stop_b.touch()
    assert job_b.wait(30) == 0
    wait_for(lambda: series_of(job_b.pid, scrape()) == [], "B's series gone after the grace",
             GRACE + 10)
    text = scrape()
    assert "dlprof_agent_samples_total" in text  # the daemon itself goes on

    agent.send_signal(signal.SIGTERM)
    assert agent.wait(15) == 0
    assert agent.stderr is not None
    log_lines = agent.stderr.read()
    assert f"watching pid {job_a.pid}" in log_lines and "loaded the probe" in log_lines
    assert f"watching pid {job_b.pid}" in log_lines and "command line matches" in log_lines
    assert "Traceback" not in log_lines


def test_env_keeps_only_the_processes_that_have_it(
        processes: list[subprocess.Popen[bytes]]) -> None:
    marker = "dlprof-env-filter-test"
    sleepers = {job: subprocess.Popen(
        [sys.executable, "-c", f"import time; time.sleep(60)  # {marker}"],
        env={**os.environ, "SLURM_JOB_ID": job}) for job in ("11", "12")}
    processes.extend(sleepers.values())
    only_11 = Discovery(DaemonOptions(matches=(re.compile(marker),),
                                      environment=(("SLURM_JOB_ID", "11"),)),
                        socket_dirs=())
    assert only_11.candidates(()) == {sleepers["11"].pid: "match"}
    every = Discovery(DaemonOptions(matches=(re.compile(marker),)), socket_dirs=())
    assert set(every.candidates(())) == {p.pid for p in sleepers.values()}


def test_the_daemon_never_takes_itself_or_its_parents_for_a_job() -> None:
    # This test process runs `python ... pytest`: a match on "python" matches it.
    discovery = Discovery(DaemonOptions(matches=(re.compile("python|pytest"),)),
                          socket_dirs=())
    found = discovery.candidates([os.getpid()])
    assert os.getpid() not in found and os.getppid() not in found


def test_probe_sockets_are_found_by_name(tmp_path: Path) -> None:
    (tmp_path / "probe-4242.sock").touch()
    (tmp_path / "probe-x.sock").touch()
    (tmp_path / "other.sock").touch()
    from dlprof_agent.probe_link.client import probe_socket_pids

    assert probe_socket_pids([str(tmp_path)]) == {4242}
    # A name alone is not a job: pid 4242 here (if any) has no socket of its own
    # there, as a container's process named by its own pid namespace would not.
    discovery = Discovery(DaemonOptions(), socket_dirs=(str(tmp_path),))
    assert 4242 not in discovery.candidates(())


def test_one_node_exposition_holds_every_target_once_per_family() -> None:
    first, second = full_snapshot(100), full_snapshot(200)
    node = NodeSnapshot(timestamp_seconds=first.timestamp_seconds,
                        monotonic_seconds=first.monotonic_seconds, host=first.host,
                        gpu=first.gpu, samples_total=3, agent=first.agent,
                        targets=tuple(dataclasses.replace(s, host=None, gpu=None)
                                      for s in (first, second)))
    registry = CollectorRegistry()
    registry.register(NodeCollector(lambda: node, interval_seconds=1.0))
    text = generate_latest(registry).decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    up = {sample.labels["pid"] for sample in families["dlprof_target_up"].samples}
    assert up == {"100", "200"}
    steps = {sample.labels["pid"] for sample in families["dlprof_steps"].samples}
    assert steps == {"100", "200"}
    # the host and the GPUs once, not once per target
    assert len(families["dlprof_host_cpus"].samples) == 2  # logical and physical
    assert text.count("# TYPE dlprof_gpu_utilization_ratio ") == 1
