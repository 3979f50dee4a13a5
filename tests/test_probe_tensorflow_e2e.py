"""The probe in real TensorFlow jobs on the CPU: model.fit under `run`, and a
custom tf.function loop that gets the probe by injection."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, agent_env, free_port, wait_for
from tests.helpers import wait_while_progressing
from tests.test_probe_torch import info_labels, metrics, steady_steps

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.e2e

JOB = str(REPO / "tests" / "jobs" / "keras_cnn.py")
BATCH = 32


def starts(log: Path) -> list[float]:
    if not log.exists():
        return []
    return [record["start"] for record in map(json.loads, log.read_text().splitlines())
            if "start" in record]


def main_thread_cpu_seconds(launcher: subprocess.Popen[bytes]) -> float:
    """CPU of the main thread of ``launcher``'s child (the job), in whole seconds: a job
    importing TensorFlow on a loaded machine spends it, a stuck one does not (its
    probe's and the agent's threads, which tick on their own, are not counted)."""
    with contextlib.suppress(psutil.Error, IndexError, StopIteration):
        job = psutil.Process(launcher.pid).children()[0]
        main = next(thread for thread in job.threads() if thread.id == job.pid)
        return float(int(main.user_time + main.system_time))
    return 0.0


def test_run_times_model_fit_steps_like_the_jobs_own_callback(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    log = tmp_path / "job.jsonl"
    port = free_port()
    run = subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent", "run", "--port", str(port), "--quiet",
         "--interval", "0.2", "--grace", "5", "--warmup-steps", "5", "--",
         sys.executable, JOB, "--log", str(log), "--steps", "120", "--linger", "3"],
        env=agent_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    processes.append(run)
    try:
        wait_while_progressing(lambda: log.exists() and '"done"' in log.read_text(),
                               lambda: (len(starts(log)), main_thread_cpu_seconds(run)), 180,
                               what="the job to finish fitting")
    except AssertionError as error:
        run.kill()
        said = run.communicate(timeout=30)[1].decode(errors="replace")[-2000:]
        raise AssertionError(f"{error}; the agent said: {said}") from None
    time.sleep(1.0)  # five sampling intervals: the agent has read the final totals
    values = metrics(port)
    steady = int(values["dlprof_steps_total{phase=steady}"])
    assert steady >= 20
    assert values["dlprof_samples_total{phase=steady}"] == steady * BATCH
    # Keras steps are marked when each batch starts, as the job's callback marks them.
    begun = starts(log)
    job_seconds = begun[-1] - begun[-1 - steady]
    assert values["dlprof_step_duration_seconds_sum{}"] == pytest.approx(job_seconds, rel=0.02)
    labels = info_labels(port)
    assert labels["framework"] == "tensorflow"
    assert labels["intra_op_threads"] == "1"  # the job sets it
    assert labels["data_layout"] == "NHWC"
    assert run.wait(60) == 0


def test_injection_reaches_a_custom_tf_function_loop(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    log = tmp_path / "job.jsonl"
    job = subprocess.Popen([sys.executable, JOB, "--log", str(log), "--loop", "custom",
                            "--steps", "1000000"],
                           env=agent_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    processes.append(job)
    wait_for(lambda: len(starts(log)) >= 5, "the job's first steps", 120)
    port = free_port()
    agent = subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent", "attach", str(job.pid), "--port", str(port),
         "--quiet", "--interval", "0.2", "--warmup-steps", "3"],
        env=agent_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    processes.append(agent)
    wait_for(lambda: steady_steps(port) >= 20, "steps from the injected probe", 60)
    values = metrics(port)
    assert values["dlprof_samples_total{phase=steady}"] >= 20 * BATCH
    assert values["dlprof_probe_hook_errors_total{}"] == 0
    assert values["dlprof_probe_cpu_seconds_total{part=hooks}"] > 0  # Keras's hooks priced
    assert job.poll() is None
