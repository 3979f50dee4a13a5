"""One TensorFlow MultiWorkerMirroredStrategy job of two workers on this machine
(`dlprof-agent workload run --ranks 2`, the probe loaded as `dlprof-agent run`
loads it), read by one `dlprof-agent daemon`: both workers are targets of their
own, labelled with one job_id (from TF_CONFIG's cluster) and their own rank, and
their phases still add up to their step time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dlprof_agent.probe.bootstrap import preload_environment
from tests.conftest import REPO, agent_env, free_port, http_get, wait_for

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.slow

Series = list[tuple[str, dict[str, str], float]]


def scrape(port: int) -> Series:
    text = http_get(f"http://127.0.0.1:{port}/metrics").decode()
    return [(sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(text) for sample in family.samples]


def test_two_tensorflow_workers_are_one_job_with_two_ranks(
        processes: list[subprocess.Popen[bytes]]) -> None:
    marker = uuid.uuid4().hex  # this test's job only, whatever else runs here
    port = free_port()
    processes.append(subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent", "daemon", "--port", str(port), "--quiet",
         "--no-gpu", "--no-inject", "--interval", "0.5", "--scan-interval", "0.5",
         "--env", f"DLPROF_FLEET_TEST={marker}", "--node-name", "node-a"],
        cwd=REPO, env=agent_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    environ = preload_environment({**agent_env(), "DLPROF_FLEET_TEST": marker,
                                   "TF_CPP_MIN_LOG_LEVEL": "2"})
    environ.pop("DLPROF_JOB_ID", None)
    # A small model: the workers all-reduce its gradients over gRPC every step, and
    # fcn-s's 55M parameters made that minutes of the suite for the same checks.
    launcher = subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent", "workload", "run", "--framework",
         "tensorflow", "--model", "small-cnn", "--scale", "tiny", "--ranks", "2",
         "--iterations", "1000000"],
        cwd=REPO, env=environ, start_new_session=True, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    processes.append(launcher)

    def ranks() -> dict[str, dict[str, str]]:
        steady = [labels for name, labels, value in scrape(port)
                  if name == "dlprof_steps_total" and labels["phase"] == "steady"
                  and value >= 20]
        return {labels["pid"]: labels for labels in steady}

    try:
        found = wait_for(lambda: len(ranks()) == 2 and ranks(), "steady steps of both workers",
                         240)
        assert len({labels["job_id"] for labels in found.values()}) == 1
        assert next(iter(found.values()))["job_id"] != ""
        assert sorted(labels["rank"] for labels in found.values()) == ["0", "1"]
        series = scrape(port)
        info = {labels["pid"]: labels for name, labels, _ in series
                if name == "dlprof_target_info"}
        for pid in found:
            assert info[pid]["role"] == "rank" and info[pid]["node"] == "node-a"
            assert info[pid]["world_size"] == "2"
        assert info[str(launcher.pid)]["role"] == "launcher"
        for pid in found:
            step = sum(v for name, labels, v in series
                       if name == "dlprof_step_duration_seconds_sum" and labels["pid"] == pid)
            phases = sum(v for name, labels, v in series
                         if name == "dlprof_step_phase_seconds_total" and labels["pid"] == pid)
            assert phases == pytest.approx(step, rel=0.02), (pid, phases, step)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
