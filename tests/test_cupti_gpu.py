"""Kernel tracing on a real GPU (``-m gpu``): the evidence only CUPTI can give.

- kernel totals of ResNet-50 steps, probe injected, against torch.profiler's
  for the same number of steps of the same job: within 5%, before and after
  torch.profiler has run in the job (Kineto leaves its clock registered); the
  injected job's weights bit for bit those of an untouched run;
- memcpy bytes of a known transfer, exactly;
- `dlprof-agent trace` writes valid Chrome trace JSON, and its kernels agree;
- continuous aggregation costs at most 3% of the step time;
- torch.profiler makes the tracer `busy`, both keep working, and it comes back;
  with the probe attached it gets at least 98% of the kernels it gets without;
- the dashboards' GPU and kernel panels have data on the shipped Prometheus.

They need an NVIDIA GPU, PyTorch with CUDA, and the cupti-python of torch's
CUPTI major.minor in this environment (the job's), e.g. ``pip install
'cupti-python==13.0.*'`` beside torch 2.11+cu130 (CUPTI 13.0.85): the probe's
``unavailable`` reason names the exact pin. ``scripts/gpu-check`` runs them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dlprof_agent.collectors.target import Target
from dlprof_agent.grafana import build as dashboards
from dlprof_agent.reach.call_plan import plan_calls
from dlprof_agent.reach.cpus import this_cpu
from dlprof_agent.reach.runtime import find_python_runtime
from tests import test_dashboards as dashboards_test
from tests.conftest import REPO, Prometheus, agent_env, free_port, wait_for
from tests.test_dashboards import models, shipped_prometheus
from tests.test_probe_torch import metrics

pytestmark = pytest.mark.gpu
__all__ = ["models", "shipped_prometheus"]  # fixtures, used by name
torch = pytest.importorskip("torch")

JOB = str(REPO / "tests" / "jobs" / "torch_gpu.py")
MEMSET = "[memset]"


@pytest.fixture(autouse=True)
def _needs_gpu_and_cupti() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here")
    if importlib.util.find_spec("cupti") is None:
        from dlprof_agent.probe import cupti_versions

        version = cupti_versions.framework_cupti_version(torch.version.cuda)
        pytest.fail(f"cupti-python is not installed: {cupti_versions.install_command(version)}")


class GpuJob:
    def __init__(self, tmp_path: Path, processes: list[subprocess.Popen[bytes]],
                 *args: str) -> None:
        self.control = tmp_path / "control"
        self.control.mkdir(exist_ok=True)
        self.log = tmp_path / f"gpu-job-{len(processes)}.jsonl"
        self.process = subprocess.Popen(
            [sys.executable, JOB, "--log", str(self.log), "--control", str(self.control),
             *args], env=agent_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        processes.append(self.process)

    @property
    def pid(self) -> int:
        return self.process.pid

    def records(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]

    def steps(self) -> int:
        return sum(1 for record in self.records() if "end" in record)

    def ends(self) -> list[float]:
        return [record["end"] for record in self.records() if "end" in record]

    def wait_steps(self, count: int, timeout: float = 300) -> None:
        wait_for(lambda: self.steps() >= count or self.process.poll() is not None,
                 f"{count} steps of the GPU job", timeout)
        assert self.process.poll() is None, self.process.stderr.read().decode()[-2000:] \
            if self.process.stderr else "the job died"

    def paused_at(self, step: int) -> bool:
        return any(record.get("paused") == step for record in self.records())

    def weights_after(self, step: int, timeout: float = 300) -> str:
        """The SHA-256 of a --deterministic job's weights after ``step`` (a pause or its end)."""
        def digest() -> str:
            return next((str(record["weights"]) for record in self.records()
                         if "weights" in record and record.get("step") == step), "")

        wait_for(lambda: digest() or self.process.poll() is not None,
                 f"the weights after step {step}", timeout)
        found = digest()
        assert found, self.process.stderr.read().decode()[-2000:] \
            if self.process.stderr else "the job died"
        return found

    def resume(self, step: int) -> None:
        (self.control / f"resume-{step}").touch()

    def profile(self, number: int, timeout: float = 300) -> dict[str, Any]:
        (self.control / "profile").touch()
        out = self.control / f"profile-{number}.json"
        wait_for(out.exists, "torch.profiler's steps", timeout)
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def start_agent(processes: list[subprocess.Popen[bytes]], *args: str) -> int:
    port = free_port()
    processes.append(subprocess.Popen(
        [sys.executable, "-m", "dlprof_agent", *args, "--port", str(port), "--quiet",
         "--interval", "0.5"], env=agent_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE))
    return port


def kernel_seconds(values: dict[str, float]) -> float:
    """All kernel time the agent served, memsets apart (torch.profiler counts them apart)."""
    return sum(value for name, value in values.items()
               if name.startswith("dlprof_kernel_seconds_total{") and MEMSET not in name)


def print_record_clock(values: dict[str, float]) -> None:
    """Which clock the records counted in and how the probe told (for the evidence)."""
    clock = {k: v for k, v in values.items() if k.startswith(("dlprof_cupti_record_clock",
                                                               "dlprof_cupti_unmeasured"))}
    print(f"\nrecord clock: {clock}")


def active(port: int) -> bool:
    return metrics(port).get("dlprof_kernel_tracing_state{reason=,state=active}") == 1


def missing_injector() -> str | None:
    """Why the agent has no injector for a job on this Python, or None. The job runs
    this very interpreter, so this asks what ``reach.inject._inject`` would pick:
    sys.remote_exec (3.14+), else the agent's ptrace injector (x86-64, where it finds
    its calls in the interpreter), else gdb."""
    version = "{}.{}".format(*sys.version_info[:2])
    if hasattr(sys, "remote_exec"):
        if getattr(sys, "is_remote_debug_enabled", lambda: True)():
            return None
        return (f"Python {version}'s remote debugging is off (PYTHON_DISABLE_REMOTE_DEBUG, "
                "-X disable_remote_debug, or built without it): sys.remote_exec cannot inject")
    if this_cpu() is None:
        ptrace = f"the agent's ptrace injector is for x86-64 and arm64, not {platform.machine()}"
    else:
        runtime = find_python_runtime(Target.of(os.getpid()))
        if runtime is not None and plan_calls(Target.of(os.getpid()), runtime) is not None:
            return None
        ptrace = ("the agent's ptrace injector finds no Py_AddPendingCall, PyRun_SimpleString, "
                  "mmap or rt_sigreturn gadget to call in this Python")
    if shutil.which("gdb") is not None:
        return None
    return (f"no injector for Python {version} here: sys.remote_exec is 3.14's, {ptrace}, "
            "and gdb is not installed")


def between_pauses(job: GpuJob, port: int, first: int, last: int) -> tuple[float, int]:
    """Kernel seconds the agent counted over steps first+1..last of a paused job."""
    wait_for(lambda: job.paused_at(first), f"the job to pause at step {first}", 300)
    time.sleep(2.0)  # CUPTI's flush period, a drain and a scrape interval, with margin
    before = kernel_seconds(metrics(port))
    job.resume(first)
    wait_for(lambda: job.paused_at(last), f"the job to pause at step {last}", 300)
    time.sleep(2.0)
    after = kernel_seconds(metrics(port))
    job.resume(last)
    return after - before, last - first


@pytest.mark.parametrize("how", ["inject", "enabled"])
def test_resnet50_kernel_totals_match_torch_profiler_within_5_percent(
        how: str, processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    missing = missing_injector() if how == "inject" else None
    if missing is not None:
        pytest.skip(missing)
    # Injected: deterministic, so that its weights can be compared with an untouched run's
    job = GpuJob(tmp_path, processes, "--pause-at", "60,100",
                 *(["--enable-probe"] if how == "enabled" else ["--deterministic"]))
    job.wait_steps(10)
    profiled = job.profile(0)  # steps 11..20, before any agent
    port = start_agent(processes, "attach", str(job.pid),
                       *(["--no-inject"] if how == "enabled" else []))
    wait_for(lambda: active(port), "the kernel tracer to start", 120)

    seconds, steps = between_pauses(job, port, 60, 100)

    ours = seconds / steps
    theirs = profiled["kernel_us"] / 1e6 / profiled["steps"]
    assert ours == pytest.approx(theirs, rel=0.05), (ours, theirs)
    values = metrics(port)
    print_record_clock(values)
    assert values["dlprof_cupti_dropped_records_total{}"] == 0
    top = max((v, k) for k, v in values.items() if k.startswith("dlprof_kernel_seconds_total{"))
    assert "other" not in top[1]  # a named kernel leads, not the cap's bucket
    if how == "inject":
        assert_computed_as_if_untouched(job, 100, processes, tmp_path)


def assert_computed_as_if_untouched(job: GpuJob, step: int,
                                    processes: list[subprocess.Popen[bytes]],
                                    tmp_path: Path) -> None:
    """The --deterministic ``job``, probe injected and traced, holds the same weights
    after ``step`` as a run of the same job that nothing touched."""
    reached = job.weights_after(step)
    assert job.process.poll() is None, "the job died after the injection"
    job.process.kill()  # the GPU to the untouched run alone
    job.process.wait(30)
    untouched = GpuJob(tmp_path, processes, "--deterministic", "--steps", str(step))
    expected = untouched.weights_after(step)
    untouched.process.wait(60)
    stderr = untouched.process.stderr.read().decode() if untouched.process.stderr else ""
    unsure = [line for line in stderr.splitlines() if "deterministic" in line]
    assert reached == expected, (f"the injected job's weights after step {step} are not an "
                                 f"untouched run's; ops without a deterministic kernel: {unsure}")


def test_memcpy_bytes_match_a_known_transfer(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    size, steps = 8 << 20, 50
    job = GpuJob(tmp_path, processes, "--copy-bytes", str(size), "--enable-probe",
                 "--pause-at", f"1,{1 + steps}")
    job.wait_steps(1)
    port = start_agent(processes, "attach", str(job.pid), "--no-inject")
    wait_for(lambda: active(port), "the kernel tracer to start", 120)

    def copied(kind: str) -> float:
        return metrics(port).get(f"dlprof_memcpy_bytes_total{{gpu=0,kind={kind}}}", 0.0)

    time.sleep(2.0)
    before = {kind: copied(kind) for kind in ("h2d", "d2h")}
    job.resume(1)
    wait_for(lambda: job.paused_at(1 + steps), "the copies", 120)
    time.sleep(2.0)
    for kind in ("h2d", "d2h"):
        assert copied(kind) - before[kind] == steps * size, kind
    seconds = metrics(port)["dlprof_memcpy_seconds_total{gpu=0,kind=h2d}"]
    assert steps * size / seconds > 1e9  # pinned memory: well over 1 GB/s while copying
    job.resume(1 + steps)


def test_trace_writes_valid_chrome_json_whose_kernels_agree_with_torch_profiler(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    job = GpuJob(tmp_path, processes, "--enable-probe")
    job.wait_steps(10)
    profiled = job.profile(0)
    port = start_agent(processes, "attach", str(job.pid), "--no-inject", "--layers")
    wait_for(lambda: active(port), "the kernel tracer to start", 120)
    output = tmp_path / "resnet50.json"

    result = subprocess.run([sys.executable, "-m", "dlprof_agent", "trace", str(job.pid),
                             "--steps", "10", "-o", str(output)], env=agent_env(),
                            capture_output=True, text=True, timeout=300, check=False)

    assert result.returncode == 0, result.stderr
    document = json.loads(output.read_text())
    events = document["traceEvents"]
    assert document["otherData"]["steps"] == 10
    for event in events:
        assert event["ph"] in ("X", "i", "M")
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] == "X":
            assert isinstance(event["ts"], float | int) and event["dur"] >= 0
    kernels = [e for e in events if e.get("cat") == "kernel"]
    layers = [e for e in events if e.get("cat") == "layer"]
    assert kernels and layers
    assert all(e["pid"] >= (1 << 30) for e in kernels)  # on the GPU's tracks
    ours = sum(e["dur"] for e in kernels) / 1e6 / 10
    theirs = profiled["kernel_us"] / 1e6 / profiled["steps"]
    assert ours == pytest.approx(theirs, rel=0.05), (ours, theirs)
    assert sum(1 for e in kernels if "layer" in e["args"]) > len(kernels) / 2
    assert active(port)  # back to aggregating


def median_step(ends: list[float], start: float, end: float) -> float:
    inside = [b - a for a, b in itertools.pairwise(ends) if start <= a and b <= end]
    assert len(inside) >= 20, "too few steps in a window to compare"
    return statistics.median(inside)


def test_continuous_aggregation_costs_at_most_3_percent_of_the_step_time(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    job = GpuJob(tmp_path, processes, "--enable-probe")
    job.wait_steps(30)
    window = 8.0
    medians: dict[str, list[float]] = {"kernels": [], "no-kernels": []}
    for _ in range(3):  # interleaved, so drift in clocks or heat hits both alike
        for mode in ("kernels", "no-kernels"):
            agent = subprocess.Popen(
                [sys.executable, "-m", "dlprof_agent", "attach", str(job.pid), "--no-inject",
                 "--port", "0", "--quiet", "--duration", str(window + 3),
                 *(["--no-kernels"] if mode == "no-kernels" else [])],
                env=agent_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            processes.append(agent)
            started = time.perf_counter()
            agent.wait(window + 60)
            # The first 2 s: CUPTI starting up. The last second: the agent leaving.
            medians[mode].append(median_step(job.ends(), started + 2, started + window + 2))
    overhead = statistics.median(medians["kernels"]) / statistics.median(
        medians["no-kernels"]) - 1
    assert overhead <= 0.03, medians


def test_torch_profiler_makes_the_tracer_busy_and_both_keep_working(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    job = GpuJob(tmp_path, processes, "--enable-probe", "--profile-steps", "200")
    job.wait_steps(5)
    port = start_agent(processes, "attach", str(job.pid), "--no-inject")
    wait_for(lambda: active(port), "the kernel tracer to start", 120)
    before = kernel_seconds(metrics(port))

    (job.control / "profile").touch()
    wait_for(lambda: metrics(port).get("dlprof_kernel_tracing_state{reason=torch.profiler is "
                                       "running,state=busy}") == 1, "busy", 60)
    wait_for((job.control / "profile-0.json").exists, "the profiler's steps", 600)
    profiled = json.loads((job.control / "profile-0.json").read_text())
    assert profiled["kernels"] > 0  # the profiler got its kernels: we stood aside
    wait_for(lambda: active(port), "the tracer to come back", 60)
    during = kernel_seconds(metrics(port))
    wait_for(lambda: kernel_seconds(metrics(port)) > during, "kernels counted again", 60)
    assert during >= before  # counters stayed monotonic throughout
    print_record_clock(metrics(port))  # kernels counted again: the clock is known
    assert job.process.poll() is None


def test_a_profiler_already_running_is_named_and_waited_for(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    job = GpuJob(tmp_path, processes, "--enable-probe", "--profile-steps", "300")
    job.wait_steps(5)
    (job.control / "profile").touch()
    wait_for(lambda: any(r.get("profiled") for r in job.records()), "the profiler", 120)
    port = start_agent(processes, "attach", str(job.pid), "--no-inject")

    def busy() -> bool:
        return any(value == 1 and "state=busy" in name for name, value in metrics(port).items()
                   if name.startswith("dlprof_kernel_tracing_state"))

    wait_for(busy, "busy while the profiler runs", 60)
    wait_for((job.control / "profile-0.json").exists, "the profiler's end", 600)
    wait_for(lambda: active(port), "active after it", 60)


def test_layer_gpu_time_covers_most_kernel_time(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    job = GpuJob(tmp_path, processes, "--enable-probe")
    job.wait_steps(5)
    port = start_agent(processes, "attach", str(job.pid), "--no-inject", "--layers")
    wait_for(lambda: active(port), "the kernel tracer to start", 120)
    time.sleep(10)
    values = metrics(port)
    layers = sum(v for k, v in values.items() if k.startswith("dlprof_layer_gpu_seconds_total"))
    kernels = kernel_seconds(values)
    # Kernels outside any layer: the loss, the optimizer's update, zero_grad.
    assert 0.5 * kernels <= layers <= kernels
    assert any("phase=backward" in k for k in values if k.startswith("dlprof_layer_gpu"))


def test_resnet50_kernel_totals_match_before_torch_profiler_ever_ran(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    job = GpuJob(tmp_path, processes, "--pause-at", "40,80", "--enable-probe")
    job.wait_steps(5)
    port = start_agent(processes, "attach", str(job.pid), "--no-inject")
    wait_for(lambda: active(port), "the kernel tracer to start", 120)
    seconds, steps = between_pauses(job, port, 40, 80)
    profiled = job.profile(0)  # afterwards: our figures came from CUPTI's own clock
    theirs = profiled["kernel_us"] / 1e6 / profiled["steps"]
    assert seconds / steps == pytest.approx(theirs, rel=0.05), (seconds / steps, theirs)


def test_torch_profiler_gets_its_kernels_with_the_probe_attached(
        processes: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    job = GpuJob(tmp_path, processes, "--enable-probe", "--profile-steps", "20")
    job.wait_steps(10)
    alone = job.profile(0)
    port = start_agent(processes, "attach", str(job.pid), "--no-inject")
    wait_for(lambda: active(port), "the kernel tracer to start", 120)
    time.sleep(2.0)
    beside = job.profile(1)
    print(f"\ntorch.profiler kernels per step: {alone['kernels'] / alone['steps']:.1f} alone, "
          f"{beside['kernels'] / beside['steps']:.1f} with the probe attached")
    assert beside["kernels"] / beside["steps"] >= 0.98 * alone["kernels"] / alone["steps"]
    assert beside["kernel_us"] == pytest.approx(alone["kernel_us"], rel=0.05)
    wait_for(lambda: active(port), "the tracer to come back", 60)


@pytest.fixture
def training(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """The ResNet-50 job under `dlprof-agent run --layers`, for the shipped Prometheus
    (``tests.test_dashboards.shipped_prometheus``): (the agent's port, the job's pid)."""
    port, log, control = free_port(), tmp_path / "job.jsonl", tmp_path / "control"
    control.mkdir()
    pid = 0
    with open(tmp_path / "agent.log", "wb") as agent_log:
        run = subprocess.Popen(
            [sys.executable, "-m", "dlprof_agent", "run", "--port", str(port), "--quiet",
             "--interval", "0.5", "--grace", "0", "--layers", "--", sys.executable, JOB,
             "--log", str(log), "--control", str(control), "--steps", "100000",
             "--copy-every", "5"],
            env=agent_env(), stdout=subprocess.DEVNULL, stderr=agent_log)
    try:
        def first_line() -> str:
            text = log.read_text() if log.exists() else ""
            return text.partition("\n")[0] if "\n" in text else ""

        pid = int(json.loads(wait_for(first_line, "the job to start", 120))["pid"])
        yield port, pid
    finally:
        run.terminate()  # `run` passes it on to the job
        try:
            run.wait(30)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait(10)
        with contextlib.suppress(Exception):
            os.kill(pid, signal.SIGKILL)  # whatever `run` left


def test_gpu_and_kernel_panels_have_data_on_the_shipped_prometheus(
        shipped_prometheus: Prometheus, models: dict[str, dict[str, Any]]) -> None:
    prometheus = shipped_prometheus
    wait_for(lambda: prometheus.query("sum(rate(dlprof_kernel_seconds_total[1m])) > 0"),
             "kernel time in Prometheus", 180)
    time.sleep(4 * dashboards_test.scrape_interval_seconds())  # rates need a few scrapes
    with_data: list[str] = []
    empty: list[str] = []
    for name, model in models.items():
        for panel in dashboards.panels(model):
            if not dashboards_test.needs_gpu(panel):
                continue
            answers = [prometheus.query(dashboards_test.substitute(t["expr"]))
                       for t in panel["targets"]]
            (with_data if all(answers) else empty).append(f"{name}: {panel['title']}")
    print(f"\n{len(with_data)} GPU and kernel panels with data; empty: {empty}")
    # Throttling shows only when the GPU throttles; everything else must have data.
    assert [title for title in empty if "Throttle" not in title] == []
