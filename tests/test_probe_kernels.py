"""Kernel tracing end to end, on the CPU: a real PyTorch job with the probe, an
agent attached over the socket, `dlprof-agent trace`. The job's probe traces a
simulated GPU (``tests.fake_cupti.SimulatedGpu``: synthetic CUPTI buffers at the
binding seam, one kernel per layer launch); everything above it is the real
thing. A job on the CPU shows what happens without CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import agent_env, wait_for
from tests.fake_cupti import SimulatedGpu
from tests.test_probe_torch import metrics, start_agent, start_job, wait_for_steps

pytest.importorskip("torch")
pytestmark = pytest.mark.e2e

KERNEL = "simulated::layer_kernel"


def trace(pid: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dlprof_agent", "trace", str(pid),
                           "--no-inject", *args], env=agent_env(), capture_output=True,
                          text=True, timeout=120, check=False)


def test_attach_serves_kernels_copies_and_kernel_time_per_layer(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    job = start_job(processes, tmp_path, "--enable-probe", "--fake-cupti", "--steps", "100000")
    wait_for_steps(job, 2)
    _agent, port = start_agent(processes, "attach", str(job.process.pid), "--no-inject",
                               "--layers", "--warmup-steps", "1")
    wait_for(lambda: metrics(port).get(f"dlprof_kernel_launches_total{{gpu=0,kernel={KERNEL}}}",
                                       0) > 50, "kernels to be counted", 60)
    values = metrics(port)

    assert values["dlprof_kernel_tracing_state{reason=,state=active}"] == 1
    assert values["dlprof_kernel_tracing_state{reason=,state=busy}"] == 0
    launches = values[f"dlprof_kernel_launches_total{{gpu=0,kernel={KERNEL}}}"]
    assert values[f"dlprof_kernel_seconds_total{{gpu=0,kernel={KERNEL}}}"] == pytest.approx(
        launches * 20e-6)
    assert values["dlprof_kernel_duration_seconds_count{gpu=0}"] == launches
    assert values["dlprof_memcpy_bytes_total{gpu=0,kind=h2d}"] >= SimulatedGpu.COPY_BYTES
    # The small CNN's first layer ("0 Conv2d") launched kernels in both phases.
    assert values["dlprof_layer_gpu_seconds_total{layer=0 Conv2d,phase=forward}"] > 0
    assert values["dlprof_layer_gpu_seconds_total{layer=0 Conv2d,phase=backward}"] > 0
    assert values["dlprof_cupti_dropped_records_total{}"] == 0
    assert values["dlprof_probe_hook_errors_total{}"] == 0


def test_no_kernels_switches_continuous_tracing_off(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    job = start_job(processes, tmp_path, "--enable-probe", "--fake-cupti", "--steps", "100000")
    wait_for_steps(job, 2)
    _agent, port = start_agent(processes, "attach", str(job.process.pid), "--no-inject",
                               "--no-kernels")
    wait_for(lambda: metrics(port).get("dlprof_steps_total{phase=warmup}", 0) >= 2,
             "steps", 60)
    values = metrics(port)
    assert values["dlprof_kernel_tracing_state{reason=switched off (--no-kernels),"
                  "state=unavailable}"] == 1
    assert not [name for name in values if name.startswith("dlprof_kernel_seconds")]


def check_trace(path: Path, steps: int, *, layers: bool) -> dict[str, int]:
    document = json.loads(path.read_text())
    events = document["traceEvents"]
    assert document["otherData"]["steps"] == steps
    for event in events:
        assert event["ph"] in ("X", "i", "M") and isinstance(event["pid"], int)
        if event["ph"] == "X":
            assert event["dur"] >= 0
    counts: dict[str, int] = {}
    for event in events:
        if event["ph"] == "X":
            counts[event["cat"]] = counts.get(event["cat"], 0) + 1
    assert counts["step"] == steps
    assert counts.get("kernel", 0) > 0 and counts.get("memcpy", 0) > 0
    assert (counts.get("layer", 0) > 0) == layers
    window = [e["ts"] for e in events if e.get("cat") == "step" and e["ph"] == "i"]
    assert len(window) == steps + 1
    # Every kernel of the window was launched inside it (the simulated GPU runs it 1 us later).
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert all(window[0] <= e["ts"] <= window[-1] + 1000 for e in kernels)
    assert {e["name"] for e in kernels} == {KERNEL}
    return counts


def test_trace_beside_an_attached_agent_writes_a_chrome_trace(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    job = start_job(processes, tmp_path, "--enable-probe", "--fake-cupti", "--steps", "100000")
    wait_for_steps(job, 2)
    _agent, port = start_agent(processes, "attach", str(job.process.pid), "--no-inject",
                               "--layers")
    wait_for(lambda: metrics(port).get("dlprof_kernel_tracing_state{reason=,state=active}"),
             "the tracer to start", 60)
    output = tmp_path / "beside.json"

    result = trace(job.process.pid, "--steps", "3", "-o", str(output))

    assert result.returncode == 0, result.stderr
    assert f"wrote {output}: 3 steps" in result.stdout
    assert "tracing pid" in result.stderr  # progress, on stderr
    counts = check_trace(output, 3, layers=True)
    assert counts["layer"] >= 3 * 2 * 10  # ten leaf layers, forward and backward, 3 steps
    assert metrics(port)["dlprof_probe_up{}"] == 1  # the agent kept its probe throughout


def test_trace_alone_takes_its_own_session_and_gives_it_back(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    job = start_job(processes, tmp_path, "--enable-probe", "--fake-cupti", "--steps", "100000")
    wait_for_steps(job, 2)
    output = tmp_path / "alone.json"
    result = trace(job.process.pid, "--steps", "2", "-o", str(output))
    assert result.returncode == 0, result.stderr
    check_trace(output, 2, layers=True)
    # The session ended with the trace: another agent can attach at once.
    _agent, port = start_agent(processes, "attach", str(job.process.pid), "--no-inject")
    wait_for(lambda: metrics(port).get("dlprof_probe_up{}") == 1, "a new agent's probe", 30)


def test_a_cpu_job_has_no_kernels_and_trace_says_why_in_one_line(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    job = start_job(processes, tmp_path, "--enable-probe", "--steps", "100000")
    wait_for_steps(job, 2)
    _agent, port = start_agent(processes, "attach", str(job.process.pid), "--no-inject")
    wait_for(lambda: metrics(port).get(
        "dlprof_kernel_tracing_state{reason=no CUDA in use,state=unavailable}") == 1,
        "the tracer's state", 30)

    result = trace(job.process.pid, "--steps", "2", "-o", str(tmp_path / "none.json"))

    assert result.returncode == 8
    lines = result.stderr.strip().splitlines()
    assert lines == ["dlprof-agent: error: no GPU in use: the process has not started CUDA: "
                     "trace a job that trains on a GPU"]
    assert not (tmp_path / "none.json").exists()
    assert metrics(port)["dlprof_probe_up{}"] == 1


def test_trace_of_a_process_without_a_probe_is_one_line(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    job = start_job(processes, tmp_path, "--steps", "100000")
    wait_for_steps(job, 1)
    result = trace(job.process.pid, "--steps", "2", "-o", str(tmp_path / "none.json"))
    assert result.returncode == 8
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"dlprof-agent: error: no probe in process {job.process.pid}: ")
    assert "--no-inject" in line


def test_the_probe_stands_aside_for_torch_profiler_and_comes_back(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    """The real hooks on torch's profiler entry points, in a real job: busy while
    torch.profiler runs, active again after, the counters monotonic throughout."""
    start = tmp_path / "profile"
    job = start_job(processes, tmp_path, "--enable-probe", "--fake-cupti", "--steps", "100000",
                    "--profile-when", str(start), "--profile-seconds", "3")
    wait_for_steps(job, 2)
    # The simulated GPU runs a kernel per layer launch: it needs the layer hooks.
    _agent, port = start_agent(processes, "attach", str(job.process.pid), "--no-inject",
                               "--layers")
    launches = f"dlprof_kernel_launches_total{{gpu=0,kernel={KERNEL}}}"
    wait_for(lambda: metrics(port).get("dlprof_kernel_tracing_state{reason=,state=active}"),
             "the tracer to start", 60)
    start.touch()
    busy = "dlprof_kernel_tracing_state{reason=torch.profiler is running,state=busy}"
    wait_for(lambda: metrics(port).get(busy) == 1, "the tracer to stand aside", 60)
    during = metrics(port).get(launches, 0.0)
    wait_for(lambda: any("profiled" in json.loads(line) for line in
                         job.log.read_text().splitlines() if line.strip()),
             "the profiler's end", 60)
    (profiled,) = [json.loads(line)["profiled"] for line in job.log.read_text().splitlines()
                   if line.strip() and "profiled" in json.loads(line)]
    assert profiled > 0  # the user's profiler got its events
    # Stood aside synchronously, inside torch.profiler's start, not on a later tick.
    assert {"tracer_when_profiling": "busy"} in [json.loads(line) for line in
                                                 job.log.read_text().splitlines() if line]
    wait_for(lambda: metrics(port).get("dlprof_kernel_tracing_state{reason=,state=active}"),
             "the tracer to come back", 30)
    wait_for(lambda: metrics(port).get(launches, 0.0) > during, "kernels counted again", 30)
    assert metrics(port)["dlprof_probe_hook_errors_total{}"] == 0
