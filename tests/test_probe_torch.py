"""The probe in real PyTorch jobs on the CPU: launched under `run`, injected into
a running job, opted into from code; killed, fed garbage, and shared."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO, agent_env, free_port, http_get, wait_for

pytest.importorskip("torch")
pytestmark = pytest.mark.e2e

JOB = str(REPO / "tests" / "jobs" / "torch_cnn.py")
BATCH = 32


class Job:
    def __init__(self, process: subprocess.Popen[bytes], log: Path) -> None:
        self.process = process
        self.log = log

    def ends(self) -> list[float]:
        """Each finished step's end, on the job's own clock."""
        if not self.log.exists():
            return []
        return [record["end"] for record in map(json.loads, self.log.read_text().splitlines())
                if "end" in record]

    def hooks_left(self) -> int:
        """Hooks still installed when the job finished (see the job's hooks_left)."""
        last = json.loads(self.log.read_text().splitlines()[-1])
        return int(last["hooks"])

    def done(self) -> bool:
        return self.log.exists() and '"done"' in self.log.read_text()


def start_job(processes: list[subprocess.Popen[bytes]], tmp_path: Path, *args: str,
              prefix: tuple[str, ...] = ()) -> Job:
    log = tmp_path / f"job-{len(processes)}.jsonl"
    process = subprocess.Popen([*prefix, sys.executable, JOB, "--log", str(log), *args],
                               env=agent_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    processes.append(process)
    return Job(process, log)


def start_agent(processes: list[subprocess.Popen[bytes]], *args: str
                ) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent", *args, "--port", str(port), "--quiet",
         "--interval", "0.2"],
        env=agent_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    processes.append(process)
    return process, port


def metrics(port: int) -> dict[str, float]:
    """Every sample, keyed by name and its labels other than pid and the target's
    job_id and rank (this job's are those of the environment it inherits)."""
    text = http_get(f"http://127.0.0.1:{port}/metrics").decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                              if k not in ("pid", "job_id", "rank"))
            values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


def steady_steps(port: int) -> float:
    return metrics(port).get("dlprof_steps_total{phase=steady}", 0.0)


def wait_for_steps(job: Job, count: int, timeout: float = 60) -> None:
    wait_for(lambda: len(job.ends()) >= count, f"the job's first {count} steps", timeout)


def info_labels(port: int) -> dict[str, str]:
    text = http_get(f"http://127.0.0.1:{port}/metrics").decode()
    for family in text_string_to_metric_families(text):
        if family.name == "dlprof_framework_info" and family.samples:
            return dict(family.samples[0].labels)
    return {}


def test_run_reports_steps_samples_and_layers_matching_the_jobs_own_timer(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    log = tmp_path / "job.jsonl"
    port = free_port()
    run = subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent", "run", "--port", str(port), "--quiet",
         "--interval", "0.2", "--grace", "5", "--layers", "--layers-every", "1",
         "--warmup-steps", "5", "--",
         sys.executable, JOB, "--log", str(log), "--steps", "150", "--linger", "3"],
        env=agent_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    processes.append(run)
    job = Job(run, log)
    wait_for(job.done, "the job to finish its steps", 120)
    time.sleep(1.0)  # five sampling intervals: the agent has read the final totals
    values = metrics(port)
    steady = values["dlprof_steps_total{phase=steady}"]
    assert values["dlprof_probe_up{}"] == 1
    assert steady >= 20
    assert values["dlprof_samples_total{phase=steady}"] == steady * BATCH

    # The probe's steady steps are the job's last ones: compare the same steps.
    ends = job.ends()
    job_seconds = ends[-1] - ends[-1 - int(steady)]
    probe_seconds = values["dlprof_step_duration_seconds_sum{}"]
    assert probe_seconds == pytest.approx(job_seconds, rel=0.02)

    # Per-layer forward and backward cover most of the step; the rest is named.
    layers = values["dlprof_step_phase_seconds_total{phase=forward}"] + values[
        "dlprof_step_phase_seconds_total{phase=backward}"]
    assert 0.8 * probe_seconds <= layers <= probe_seconds
    phases = sum(v for k, v in values.items() if k.startswith("dlprof_step_phase_seconds"))
    assert phases == pytest.approx(probe_seconds, rel=1e-6)
    conv = values["dlprof_layer_seconds_total{layer=0 Conv2d,phase=forward}"]
    assert conv > 0
    assert values["dlprof_layer_calls_total{layer=0 Conv2d,phase=backward}"] >= steady
    assert values["dlprof_layer_sampled_steps_total{}"] == steady  # every step was timed
    # The probe prices itself: its hooks are a small part of the step, its thread ran.
    hooks = values["dlprof_probe_cpu_seconds_total{part=hooks}"]
    assert 0 < hooks < 0.2 * probe_seconds
    assert values["dlprof_probe_cpu_seconds_total{part=thread}"] > 0

    labels = info_labels(port)
    assert labels["framework"] == "pytorch"
    assert labels["intra_op_threads"] == "1"  # the job calls torch.set_num_threads(1)
    assert labels["layer_timing"] == "on"
    assert labels["data_layout"] == "NCHW"
    assert run.wait(30) == 0


def test_run_hands_on_the_commands_exit_code(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dlprof_agent", "run", "--port", "0", "--quiet", "--grace", "0",
         "--", sys.executable, "-c", "import time; time.sleep(1); raise SystemExit(3)"],
        env=agent_env(), capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr


def test_injection_reaches_a_job_started_without_the_probe_and_detach_undoes_it(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    job = start_job(processes, tmp_path, "--steps", "100000")
    wait_for_steps(job, 5)
    agent, port = start_agent(processes, "attach", str(job.process.pid),
                              "--warmup-steps", "3")
    wait_for(lambda: steady_steps(port) >= 20, "steady steps from the injected probe", 60)
    socket_path = Path(f"/tmp/dlprof-agent-{os.getuid()}/probe-{job.process.pid}.sock")
    assert socket_path.exists()

    # Stop it as Ctrl-C or a service manager would: the probe removes its hooks and
    # closes. (SIGTERM: a shell that starts the tests in the background ignores SIGINT.)
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(30) == 0
    wait_for(lambda: not socket_path.exists(), "the injected probe to close its socket", 10)

    _again, port = start_agent(processes, "attach", str(job.process.pid),
                              "--warmup-steps", "3")
    wait_for(lambda: steady_steps(port) >= 5, "steady steps after re-attaching", 60)
    assert job.process.poll() is None


def test_killing_the_agent_leaves_the_job_as_it_was_with_nothing_of_the_probe_in_a_step(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    until = tmp_path / "stop"
    job = start_job(processes, tmp_path, "--steps", "100000", "--until", str(until),
                    "--count-probe-calls", "20")
    wait_for_steps(job, 5)
    agent, port = start_agent(processes, "attach", str(job.process.pid), "--layers",
                              "--warmup-steps", "3")
    wait_for(lambda: steady_steps(port) >= 30, "steady steps with layer timing", 60)
    agent.kill()  # kill -9: no goodbye; the probe sees its socket close
    agent.wait(10)
    socket_path = Path(probe_socket(job.process.pid))
    wait_for(lambda: not socket_path.exists(), "the probe to go dormant", 10)
    killed_at = len(job.ends())
    wait_for_steps(job, killed_at + 5)
    until.touch()  # the job completes, after 20 steps that count calls into the probe
    assert job.process.wait(60) == 0
    # What would slow the job's steps: a hook, callback or wrapper of the probe still
    # called from them. Their speed is the no-harm benchmark's to measure.
    records = [json.loads(line) for line in job.log.read_text().splitlines()]
    assert [r["probe_calls"] for r in records if "probe_calls" in r] == [0]
    assert job.hooks_left() == 0  # every hook the probe installed is gone


def probe_socket(pid: int) -> str:
    return f"/tmp/dlprof-agent-{os.getuid()}/probe-{pid}.sock"


def send(path: str, data: bytes) -> bytes:
    """Write ``data`` and return whatever comes back before the probe closes."""
    reply = b""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(10)
        client.connect(path)
        try:
            client.sendall(data)
            client.shutdown(socket.SHUT_WR)
            while chunk := client.recv(65536):
                reply += chunk
        except (ConnectionResetError, BrokenPipeError):
            pass  # the probe hung up on the garbage, unread
    return reply


def test_garbage_on_the_socket_is_dropped_and_counted_and_the_job_runs_on(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    from dlprof_agent.probe.protocol import HEADER, MAGIC, encode

    job = start_job(processes, tmp_path, "--enable-probe", "--steps", "100000")
    wait_for_steps(job, 5)
    path = probe_socket(job.process.pid)
    assert send(path, os.urandom(4096)) == b""
    assert send(path, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n") == b""
    assert send(path, HEADER.pack(MAGIC, 1, 2**31)) == b""  # claims 2 GiB: never read
    assert send(path, HEADER.pack(MAGIC, 7, 2) + b"{}") == b""
    assert b"say start first" in send(path, encode({"command": "exec", "args": "rm -rf /"}))
    assert b"bad argument" in send(path, encode({"command": "start",
                                                 "args": {"layers": "__import__('os')"}}))
    assert job.process.poll() is None

    _agent, port = start_agent(processes, "attach", str(job.process.pid), "--no-inject",
                               "--warmup-steps", "2")
    wait_for(lambda: steady_steps(port) >= 5, "steps after the garbage", 60)
    values = metrics(port)
    assert values["dlprof_probe_dropped_messages_total{reason=malformed}"] == 3
    assert values["dlprof_probe_dropped_messages_total{reason=oversized}"] == 1
    assert values["dlprof_probe_dropped_messages_total{reason=version}"] == 1
    assert values["dlprof_probe_dropped_messages_total{reason=unknown}"] == 1
    assert values["dlprof_probe_hook_errors_total{}"] == 0


def test_a_connection_from_another_user_is_refused(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to connect as another user")
    job = start_job(processes, tmp_path, "--enable-probe", "--steps", "100000")
    wait_for_steps(job, 2)
    path = probe_socket(job.process.pid)
    # Open the file-system gate on purpose, so that only the peer check stands.
    os.chmod(os.path.dirname(path), 0o711)
    os.chmod(path, 0o777)
    try:
        stranger = subprocess.run(
            [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
             "-c", "import socket,sys; s=socket.socket(socket.AF_UNIX); s.settimeout(10); "
                   f"s.connect({path!r})\n"
                   "try:\n    s.sendall(b'x' * 64)\n    reply = s.recv(100)\n"
                   "except (ConnectionResetError, BrokenPipeError):\n    reply = b''\n"
                   "sys.stdout.write(repr(reply))"],
            capture_output=True, text=True, timeout=30, check=False)
    finally:
        os.chmod(os.path.dirname(path), 0o700)
    assert stranger.stdout == "b''", stranger.stderr  # closed without a word
    _agent, port = start_agent(processes, "attach", str(job.process.pid), "--no-inject")
    wait_for(lambda: metrics(port).get(
        "dlprof_probe_dropped_messages_total{reason=refused_peer}") == 1,
        "the refusal to be counted", 30)


def test_attaching_twice_is_refused_with_the_first_agents_pid(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    job = start_job(processes, tmp_path, "--enable-probe", "--steps", "100000")
    wait_for_steps(job, 2)
    first, port = start_agent(processes, "attach", str(job.process.pid), "--no-inject")
    wait_for(lambda: metrics(port).get("dlprof_probe_up{}") == 1, "the first agent", 30)
    second = subprocess.run(
        [sys.executable, "-m", "dlprof_agent", "attach", str(job.process.pid), "--port", "0",
         "--quiet"], env=agent_env(), capture_output=True, text=True, timeout=30, check=False)
    assert second.returncode == 6
    lines = second.stderr.strip().splitlines()
    assert lines[-1].startswith("dlprof-agent: error:"), second.stderr
    assert f"already has an agent attached (pid {first.pid})" in lines[-1]
    assert metrics(port).get("dlprof_probe_up{}") == 1  # the first one is unaffected


def test_a_non_python_target_is_measured_from_outside_and_left_alone(
        processes: list[subprocess.Popen[bytes]]) -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    processes.append(sleeper)
    result = subprocess.run(
        [sys.executable, "-m", "dlprof_agent", "attach", str(sleeper.pid), "--port", "0",
         "--duration", "1", "--quiet"],
        env=agent_env(), capture_output=True, text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    assert "no in-process metrics" in result.stderr
    assert "not a Python process" in result.stderr
    assert sleeper.poll() is None


def test_no_inject_says_why_the_in_process_metrics_are_missing(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    job = start_job(processes, tmp_path, "--steps", "100000")
    agent, port = start_agent(processes, "attach", str(job.process.pid), "--no-inject")
    wait_for(lambda: metrics(port).get("dlprof_probe_up{}") == 0, "the agent", 30)
    agent.send_signal(signal.SIGTERM)
    _, stderr = agent.communicate(timeout=30)
    assert b"--no-inject was given" in stderr
    assert not Path(probe_socket(job.process.pid)).exists()


def test_a_loop_without_torch_optim_still_has_steps(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    job = start_job(processes, tmp_path, "--enable-probe", "--loop", "manual-sgd",
                    "--steps", "100000")
    wait_for_steps(job, 2)
    _agent, port = start_agent(processes, "attach", str(job.process.pid), "--no-inject",
                               "--warmup-steps", "2")
    wait_for(lambda: steady_steps(port) >= 10, "steps marked by the model's forward", 60)
    values = metrics(port)
    assert values["dlprof_samples_total{phase=steady}"] >= 10 * BATCH
    assert values["dlprof_samples_total{phase=steady}"] % BATCH == 0


@pytest.mark.serial  # a fixed 8 s demo must reach steady steps: the job needs its cores
def test_demo_trains_injects_and_shows_what_prometheus_gets() -> None:
    """The README's main command, as a user runs it."""
    result = subprocess.run(
        [sys.executable, "-m", "dlprof_agent", "demo", "--duration", "8", "--port", "0"],
        env=agent_env(), capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "is training; attaching and injecting the probe" in result.stdout
    summary = next(line for line in result.stdout.splitlines()
                   if line.strip().startswith("steps"))
    assert "steady" in summary and "samples/s" in summary
    assert "top layers" in result.stdout
    scraped = [line.strip() for line in result.stdout.splitlines()]
    assert any(line.startswith("dlprof_probe_up{") and line.endswith(" 1.0")
               for line in scraped)
    assert any(line.startswith("dlprof_steps_total{") and 'phase="steady"' in line
               for line in scraped)


def test_attaching_and_detaching_write_nothing_to_the_jobs_output(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    """Injected into, timed layer by layer, then left: the job's stdout and stderr stay
    empty (no line of the probe's, no warning a framework gave because of its hooks)."""
    log, out, err = tmp_path / "job.jsonl", tmp_path / "stdout", tmp_path / "stderr"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        process = subprocess.Popen([sys.executable, JOB, "--log", str(log), "--steps", "100000"],
                                   env=agent_env(), stdout=stdout, stderr=stderr)
    processes.append(process)
    job = Job(process, log)
    wait_for_steps(job, 5)
    agent, port = start_agent(processes, "attach", str(process.pid), "--warmup-steps", "3",
                              "--layers")
    wait_for(lambda: steady_steps(port) >= 20, "steady steps from the injected probe", 60)
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(30) == 0
    left = len(job.ends())
    wait_for_steps(job, left + 5)  # it trains on, on its own again
    assert process.poll() is None
    process.kill()
    process.wait(10)
    assert (out.read_bytes(), err.read_bytes()) == (b"", b"")
