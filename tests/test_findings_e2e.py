"""Findings on real jobs: each pathology this machine can produce, run once with
the cause and once without. The agent must raise the finding on /metrics and in
its summary for the first, and judge the second without raising it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dlprof_agent.collectors.limits import LimitsCollector
from dlprof_agent.collectors.target import Target
from dlprof_agent.model.findings.rules import MAIN_WAIT_SHARE
from dlprof_agent.model.findings.tracker import RAISE_AFTER_SECONDS
from dlprof_agent.model.findings.window import MIN_WINDOW_SECONDS
from tests.conftest import agent_env, free_port, http_get

pytestmark = pytest.mark.e2e

INTERVAL = 0.25
# A cause must hold this long after the window fills before it is raised; a healthy
# run is watched as long again, plus a margin, and must never raise it.
RAISE_SECONDS = MIN_WINDOW_SECONDS + RAISE_AFTER_SECONDS
START_SECONDS = 90.0  # importing torch on a busy 2-core machine


@dataclass
class Watch:
    values: list[float]  # the finding's dlprof_finding value at each scrape that judged it
    judged_seconds: float  # from its first to its last judgement
    summary: str  # what the agent printed at the end, and its log
    evidence: dict[str, float]  # the finding's evidence at the last scrape


def _finding(port: int, finding: str, evidence: dict[str, float]
             ) -> tuple[float | None, int | None]:
    """(dlprof_finding value, the target's pid) on the agent's /metrics now; the
    finding's evidence goes into ``evidence``."""
    text = http_get(f"http://127.0.0.1:{port}/metrics").decode()
    value = pid = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("finding") != finding:
                pass
            elif sample.name == "dlprof_finding":
                value = sample.value
            elif sample.name == "dlprof_finding_evidence":
                evidence[sample.labels["quantity"]] = sample.value
            if sample.name == "dlprof_target_up" and sample.value == 1:
                pid = int(sample.labels["pid"])
    return value, pid


def watch(finding: str, command: list[str], *, expect_raised: bool,
          agent_args: tuple[str, ...] = (), attach_pid: int | None = None) -> Watch:
    """Run the agent on ``command`` (or attached to ``attach_pid``) until the finding is
    raised, or, when it is not expected, until it was judged long enough to have been."""
    port = free_port()
    options = ["--port", str(port), "--interval", str(INTERVAL), "--grace", "0", *agent_args]
    if attach_pid is None:
        argv = ["run", *options, "--", *command]
    else:
        argv = ["attach", str(attach_pid), "--no-probe", *options]
    with tempfile.TemporaryFile("w+") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "dlprof_agent", *argv],
            env=agent_env(), stdout=subprocess.PIPE, stderr=log, text=True)
        values: list[float] = []
        evidence: dict[str, float] = {}
        first_judged = last_judged = None
        pid = attach_pid
        try:
            deadline = time.monotonic() + START_SECONDS
            while time.monotonic() < deadline and agent.poll() is None:
                time.sleep(INTERVAL)
                try:
                    value, seen_pid = _finding(port, finding, evidence)
                except OSError:
                    continue  # not serving yet
                pid = pid or seen_pid
                if value is None:
                    continue
                now = time.monotonic()
                first_judged = first_judged or now
                last_judged = now
                values.append(value)
                if expect_raised and value == 1:
                    break
                if not expect_raised and now - first_judged >= RAISE_SECONDS + 3.0:
                    break
        finally:
            if pid is not None and attach_pid is None:
                os.kill(pid, signal.SIGTERM)  # the job ends; the agent prints its summary
            elif attach_pid is not None:
                agent.send_signal(signal.SIGTERM)
            try:
                summary, _ = agent.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
                summary, _ = agent.communicate()
            log.seek(0)
            summary += log.read()  # the agent's log: why, when something went wrong
    judged = 0.0 if first_judged is None or last_judged is None else last_judged - first_judged
    return Watch(values, judged, summary, evidence)


def assert_raised(result: Watch, finding: str) -> None:
    assert result.values, f"{finding} was never judged"
    assert result.values[-1] == 1, f"{finding} not raised: {result.evidence}"
    assert finding in result.summary, result.summary


def assert_not_raised(result: Watch, finding: str) -> None:
    assert result.judged_seconds >= RAISE_SECONDS, f"{finding} judged only briefly"
    assert 1 not in result.values, f"{finding} raised without its cause: {result.evidence}"
    assert finding not in result.summary, result.summary


def workload(*options: str) -> list[str]:
    return [sys.executable, "-m", "dlprof_agent", "workload", "run", "--model", "small-cnn",
            "--iterations", "1000000", "--warmup", "3", "--no-progress", *options]


@pytest.fixture(scope="module")
def torch_installed() -> None:
    pytest.importorskip("torch")


def test_thread_oversubscription_appears_with_8_threads_on_2_cpus_and_not_with_1(
        torch_installed: None) -> None:
    allowed = LimitsCollector(Target.of(os.getpid())).sample().allowed_cpus
    if allowed is None or allowed > 4:
        pytest.skip(f"needs at most 4 allowed CPUs for 8 threads to oversubscribe ({allowed})")
    finding = "thread_oversubscription"
    assert_raised(watch(finding, workload("--threads", "8"), expect_raised=True,
                        agent_args=("--no-kernels",)), finding)
    assert_not_raised(watch(finding, workload("--threads", "1"), expect_raised=False,
                            agent_args=("--no-kernels",)), finding)


@pytest.mark.parametrize("layers", [False, True], ids=["steps-only", "with-layers"])
def test_input_bound_appears_with_a_slow_loader_and_not_without(
        torch_installed: None, layers: bool) -> None:
    finding = "input_bound"
    agent_args = ("--warmup-steps", "2", *(("--layers",) if layers else ()))
    # The small CNN's step at batch 16 takes ~10 ms of a free core: 300 ms of waiting
    # for each batch is most of the step, even where neighbours slow the compute.
    assert_raised(watch(finding, workload("--threads", "1", "--batch-size", "16",
                                          "--data-delay", "0.3"),
                        expect_raised=True, agent_args=agent_args), finding)
    assert_not_raised(watch(finding, workload("--threads", "1", "--batch-size", "16"),
                            expect_raised=False, agent_args=agent_args), finding)


# ---- memory near a cgroup limit ------------------------------------------------------------

LIMIT_MIB = 256


def _own_memory_cgroup() -> tuple[Path, str] | None:
    """(the folder of this process's memory cgroup, "v1" or "v2"), if one is mounted."""
    mounts = Path("/proc/self/mounts").read_text().splitlines()
    groups = dict(line.split(":", 2)[1:] for line in
                  Path("/proc/self/cgroup").read_text().splitlines())
    for line in mounts:
        _, where, kind, options, *_ = line.split()
        if kind == "cgroup" and "memory" in options.split(",") and "memory" in groups:
            return Path(where + groups["memory"]), "v1"
    for line in mounts:
        _, where, kind, *_ = line.split()
        controllers = Path(where, "cgroup.controllers")
        if kind == "cgroup2" and controllers.exists() and "memory" in controllers.read_text():
            return Path(where + groups.get("", "/")), "v2"
    return None


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A child memory cgroup limited to LIMIT_MIB, removed afterwards."""
    found = _own_memory_cgroup()
    if found is None:
        pytest.skip("no cgroup memory controller is mounted here")
    parent, version = found
    child = parent / f"dlprof-findings-{os.getpid()}"
    try:
        child.mkdir()
        limit_file = "memory.limit_in_bytes" if version == "v1" else "memory.max"
        (child / limit_file).write_text(str(LIMIT_MIB << 20))
    except OSError as error:
        if child.exists():
            child.rmdir()
        pytest.skip(f"cannot create a memory cgroup under {parent}: {error.strerror}")
    try:
        yield child
    finally:
        for _ in range(50):  # its processes must be gone before it can be removed
            try:
                child.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _busy_in(cgroup: Path, hold_mib: int) -> subprocess.Popen[bytes]:
    """The busy workload holding ``hold_mib``, started inside ``cgroup``."""
    script = (f'echo $$ > "{cgroup}/cgroup.procs" && exec "{sys.executable}" -m '
              f"dlprof_agent.workloads.busy --threads 1 --duty 0.2 --seconds 60 "
              f"--hold-mib {hold_mib}")
    job = subprocess.Popen(["sh", "-c", script], env=agent_env(), stdout=subprocess.PIPE)
    assert job.stdout is not None
    assert job.stdout.readline().startswith(b"busy:"), "the workload did not start"
    return job


def test_memory_near_limit_appears_near_a_cgroup_limit_and_not_far_below(
        memory_cgroup: Path) -> None:
    finding = "memory_near_limit"
    for hold_mib, raised in ((LIMIT_MIB - 16, True), (32, False)):
        job = _busy_in(memory_cgroup, hold_mib)
        try:
            result = watch(finding, [], expect_raised=raised, attach_pid=job.pid)
        finally:
            job.kill()
            job.wait(10)
        if raised:
            assert_raised(result, finding)
            assert f"{LIMIT_MIB}.0 MiB" in result.summary  # the limit, in the evidence
        else:
            assert_not_raised(result, finding)



# ---- a job pinned to a CPU that busy neighbours share --------------------------------------

BUSY_LOOP = "while True:\n    sum(range(1000))\n"


def pinned(cpu: int, code: str) -> subprocess.Popen[bytes]:
    """A Python process that runs ``code`` on ``cpu`` only (it pins itself first)."""
    return subprocess.Popen(
        [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\n{code}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.mark.serial  # the control needs its CPU to itself: other tests' load would share it
def test_cpu_contention_appears_on_a_shared_core_of_a_half_idle_host_and_not_alone() -> None:
    """A rank that shares its one allowed CPU with two busy threads while the host's
    other CPUs idle: the host-wide figures cannot see it, its main thread's run-queue
    wait does. The same job alone on its CPU is judged and not raised."""
    if not os.path.exists("/proc/self/schedstat"):
        pytest.skip("this kernel keeps no schedstat (CONFIG_SCHED_INFO)")
    cpu = min(os.sched_getaffinity(0))
    finding = "cpu_contention"
    job = pinned(cpu, BUSY_LOOP)
    processes = [job]
    try:
        alone = watch(finding, [], expect_raised=False, attach_pid=job.pid)
        assert_not_raised(alone, finding)
        assert alone.evidence["main_thread_run_queue_wait_ratio"] < MAIN_WAIT_SHARE, \
            alone.evidence
        processes += [pinned(cpu, BUSY_LOOP) for _ in range(2)]
        shared = watch(finding, [], expect_raised=True, attach_pid=job.pid)
        assert_raised(shared, finding)
        assert shared.evidence["main_thread_run_queue_wait_ratio"] >= MAIN_WAIT_SHARE, \
            shared.evidence
    finally:
        for process in processes:
            process.kill()
            process.wait()
