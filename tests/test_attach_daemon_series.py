"""`attach` and `daemon` export the same series for the same process: both build
their pass with the one snapshot builder, so the families, their label names and
the target's series keys agree; only the values may differ."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import OWN_JOBS, REPO, agent_env, free_port, http_get, wait_for

pytestmark = pytest.mark.slow

JOB = str(REPO / "tests" / "jobs" / "torch_cnn.py")
INTERVAL = "0.25"
# Both see the probe the job started itself, and time its steps alike.
COMMON = ["--interval", INTERVAL, "--no-gpu", "--no-inject", "--warmup-steps", "2"]

STEADY_STEPS = 10
SETTLED_SECONDS = 4.0  # past a findings window (3 s)
Series = tuple[str, frozenset[tuple[str, str]]]


class Exposition:
    """One scrape, as the comparison reads it."""

    def __init__(self, text: str, pid: int) -> None:
        families = list(text_string_to_metric_families(text))
        self.families = {family.name for family in families}
        # Per family: the label names of its samples (histograms: their le, too).
        self.label_names = {family.name: {(sample.name, frozenset(sample.labels))
                                          for sample in family.samples}
                            for family in families}
        self.target_values: dict[Series, float] = {
            (sample.name, frozenset(sample.labels.items())): sample.value
            for family in families for sample in family.samples
            if sample.labels.get("pid") == str(pid)}
        self.target_series = set(self.target_values)
        self.collectors = {sample.labels["collector"] for family in families
                           if family.name == "dlprof_collector_errors"
                           for sample in family.samples}

    def value(self, name: str, **labels: str) -> float | None:
        """The target's series ``name`` with (at least) these labels; None if none."""
        return next((value for (sample_name, pairs), value in self.target_values.items()
                     if sample_name == name and set(labels.items()) <= pairs), None)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, str], str]]:
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir(mode=0o700)
    env = {**agent_env(), "DLPROF_AGENT_RUNTIME_DIR": str(runtime_dir)}
    log = tmp_path / "same-series-job.log"
    process = subprocess.Popen(
        [sys.executable, JOB, "--enable-probe", "--steps", "1000000", "--log", str(log),
         "--until", str(tmp_path / "stop")], cwd=REPO, env=env)
    yield process, env, re.escape(str(log))
    process.kill()
    process.wait(30)


def settled(port: int, pid: int) -> Callable[[], Exposition | None]:
    """A condition for wait_for: the scrape once the probe has timed steady steps
    (so every probe family has its series), a findings window is judged, and the
    target's series have stayed the same for SETTLED_SECONDS (more rules can judge
    as the window fills)."""
    last: list[tuple[set[Series], float]] = []

    def condition() -> Exposition | None:
        scrape = Exposition(http_get(f"http://127.0.0.1:{port}/metrics").decode(), pid)
        steady = scrape.value("dlprof_steps_total", phase="steady") or 0
        if steady < STEADY_STEPS or scrape.value(
                "dlprof_finding", finding="memory_near_limit") is None:
            return None
        now = time.monotonic()
        if not last or last[0][0] != scrape.target_series:
            last[:] = [(scrape.target_series, now)]
            return None
        return scrape if now - last[0][1] >= SETTLED_SECONDS else None

    return condition


def scrape_while_running(command: list[str], env: dict[str, str], port: int,
                         pid: int) -> Exposition:
    agent = subprocess.Popen([sys.executable, "-m", "dlprof_agent", *command,
                              "--port", str(port), *COMMON],
                             cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        scrape: Exposition = wait_for(settled(port, pid),
                                      f"{command[0]}'s settled scrape of pid {pid}", 120)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(30) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait(10)
    assert agent.stderr is not None
    assert "Traceback" not in agent.stderr.read()
    return scrape


def test_attach_and_daemon_export_the_same_series_for_one_process(
        job: tuple[subprocess.Popen[bytes], dict[str, str], str]) -> None:
    process, env, log_pattern = job
    pid = process.pid
    # One at a time: a probe serves one agent.
    attach = scrape_while_running(["attach", str(pid), "--quiet", "--grace", "0"], env,
                                  free_port(), pid)
    daemon = scrape_while_running(["daemon", "--scan-interval", INTERVAL, "--match",
                                   log_pattern, *OWN_JOBS], env, free_port(), pid)
    assert process.poll() is None, "the job ended under an agent"
    assert daemon.families == attach.families
    assert daemon.label_names == attach.label_names
    assert daemon.collectors == attach.collectors == {"process", "host", "probe", "identity"}
    only_attach = attach.target_series - daemon.target_series
    only_daemon = daemon.target_series - attach.target_series
    assert not only_attach and not only_daemon, (sorted(only_attach), sorted(only_daemon))
