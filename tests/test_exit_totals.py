"""Totals that reach Prometheus: when a job exits, its probe's counters stay on
/metrics with their final values through the grace period, beside
`dlprof_target_up 0`, so that the last scrape sees every step. Tested on a real
short job under `run`, on the agent core's own passes, and on the daemon's record of
the jobs that exited."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry

from dlprof_agent.agent.core import AgentOptions
from dlprof_agent.agent.exit_totals import ExitedTargets
from dlprof_agent.agent.serve import make_agent
from dlprof_agent.agent.snapshot_builder import target_snapshot
from dlprof_agent.collectors.target import Target
from dlprof_agent.exporters.prometheus import NodeCollector
from dlprof_agent.model.snapshot import Snapshot
from dlprof_agent.probe_link.samples import ProbeSample
from tests.conftest import REPO, agent_env, free_port, http_get, wait_for
from tests.test_findings import probe

JOB = str(REPO / "tests" / "jobs" / "torch_cnn.py")


def metric(exposition: str, name: str, extra: str = "") -> float | None:
    pattern = re.compile(rf"^{name}{{(?=[^}}]*{extra})[^}}]*}} (\S+)$", re.MULTILINE)
    found = [float(v) for v in pattern.findall(exposition)]
    return sum(found) if found else None


def test_under_run_the_last_scrape_after_the_exit_counts_every_step_of_the_job(
        tmp_path: Path, processes: list[subprocess.Popen[str]]) -> None:
    port, log = free_port(), tmp_path / "job.log"
    agent = subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent", "run", "--port", str(port), "--interval", "1",
         "--grace", "30", "--quiet", "--no-gpu", "--warmup-steps", "2", "--",
         sys.executable, JOB, "--steps", "200", "--log", str(log)],
        cwd=REPO, env=agent_env(), stderr=subprocess.PIPE, text=True)
    processes.append(agent)

    def scrape() -> str:
        return http_get(f"http://127.0.0.1:{port}/metrics").decode()

    # A scrape while it runs: the agent lingers only for an endpoint that is scraped.
    wait_for(lambda: metric(scrape(), "dlprof_steps_total"), "steps while the job runs", 90)
    ended = wait_for(lambda: (text := scrape()) and metric(text, "dlprof_target_up") == 0
                     and text, "dlprof_target_up 0 after the job's exit", 90)
    job_steps = sum(1 for line in log.read_text().splitlines() if "step" in json.loads(line))
    assert job_steps == 200
    # Step boundaries: the first optimizer step opens the first timed step.
    assert metric(ended, "dlprof_steps_total") == job_steps - 1, ended
    assert metric(ended, "dlprof_probe_up") == 0
    assert metric(ended, "dlprof_step_duration_seconds_count") == job_steps - 1 - 2
    later = scrape()  # still there, and unchanged, later in the grace period
    assert metric(later, "dlprof_target_up") == 0
    assert metric(later, "dlprof_steps_total") == job_steps - 1
    agent.terminate()  # no need to wait out the grace
    agent.wait(30)


def test_the_core_keeps_the_final_totals_of_its_one_target_that_has_gone(
        processes: list[subprocess.Popen[str]]) -> None:
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], text=True)
    processes.append(job)
    agent = make_agent(Target.of(job.pid), AgentOptions(interval=0.25, children=False, gpu=False))

    def sample_once() -> Snapshot:
        return target_snapshot(agent.sample_once(), job.pid)

    class Probe:
        up = True
        steps = 5
        stopped = False

        def sample(self) -> ProbeSample:
            self.steps += 5
            return dataclasses.replace(probe(steps=self.steps, step_seconds=1.0), pid=job.pid)

        def final_sample(self) -> ProbeSample:
            return self.sample()  # its reply to the last read, taken late

        def stop(self) -> None:
            self.stopped = True

    agent.scan()
    channel = Probe()
    agent.targets[job.pid].probe = channel  # type: ignore[assignment]
    registry = CollectorRegistry()
    registry.register(NodeCollector(lambda: agent.latest, interval_seconds=0.25))
    running = sample_once()
    assert running.identity is not None
    # The job's identity (from the environment it inherits) stays through its exit.
    steady = {"pid": str(job.pid), "job_id": running.identity.job_id,
              "rank": running.identity.rank, "phase": "steady"}
    assert running.target_up and registry.get_sample_value("dlprof_steps_total", steady) == 10
    job.kill()
    job.wait()
    gone: Snapshot = wait_for(lambda: (s := sample_once()) and not s.target_up and s,
                              "the target seen gone")
    assert not gone.probe_up and channel.stopped  # let go once its job has gone
    assert registry.get_sample_value("dlprof_target_up", {"pid": str(job.pid)}) == 0
    assert registry.get_sample_value("dlprof_steps_total", steady) == 15  # the final read
    sample_once()
    assert registry.get_sample_value("dlprof_steps_total", steady) == 15


def test_the_daemon_keeps_an_exited_job_for_the_grace_and_forgets_a_reused_pid() -> None:
    def last(pid: int, steps: int) -> Snapshot:
        return Snapshot(timestamp_seconds=0.0, monotonic_seconds=0.0, target_pid=pid,
                        target_up=True, processes=(), probe=probe(steps=steps), probe_up=True)

    exited = ExitedTargets(grace_seconds=15.0)
    exited.keep(last(11, 40), now=100.0)
    exited.keep(last(12, 70), now=110.0)
    exited.keep(None, now=110.0)  # a job that never had a pass: nothing to keep
    kept = exited.snapshots(timestamp_seconds=5.0, monotonic_seconds=112.0)
    assert [(s.target_pid, s.target_up, s.probe_up) for s in kept] == [(11, False, False),
                                                                       (12, False, False)]
    assert kept[0].probe is not None and kept[0].probe.steady_steps == 40
    assert kept[0].monotonic_seconds == 112.0 and kept[0].findings == ()
    later = exited.snapshots(timestamp_seconds=6.0, monotonic_seconds=115.0)
    assert [s.target_pid for s in later] == [12]  # 11's grace is over
    exited.forget(12)  # a new process has its pid
    assert exited.snapshots(timestamp_seconds=7.0, monotonic_seconds=116.0) == ()
    # Without a grace an exit is still published once, in the pass that saw it.
    no_grace = ExitedTargets(grace_seconds=0.0)
    no_grace.keep(last(13, 1), now=20.0)
    assert [s.target_pid for s in no_grace.snapshots(timestamp_seconds=8.0,
                                                     monotonic_seconds=20.0)] == [13]
    assert no_grace.snapshots(timestamp_seconds=9.0, monotonic_seconds=20.5) == ()
    assert len(no_grace) == 0
