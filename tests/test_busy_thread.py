"""A busy job with no thread waiting in the kernel, a single-threaded PyTorch loop
pinned to one CPU, gets the probe: the injector stops its main thread at a PC
outside Python and libc or in the eval loop's own code (``reach/safe_point.py``) and
returns it through a frame with its whole XSAVE state. Its results are bit-identical
with and without the attach, and killing the agent at any instant of the injection
leaves it to finish with the same results."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlprof_agent.collectors.target import Target
from dlprof_agent.reach.inject import inject
from tests.helpers import NO_OWN_INJECTOR, OWN_INJECTOR, wait_until
from tests.test_pure_python_loop import injecting_agent, left_stopped_or_traced

pytestmark = [
    pytest.mark.slow,  # starts PyTorch jobs
    pytest.mark.skipif(not OWN_INJECTOR, reason=NO_OWN_INJECTOR),
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch"),
    pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset"),
]

# Trains a small MLP for sys.argv[1] steps on one thread, then prints when its loop
# ended (time.monotonic) and a hash of its weights: the same bits on every run.
LOOP = """
import hashlib, sys, time, torch
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data, target = torch.randn(64, 256), torch.randint(0, 10, (64,))
print("ready", flush=True)
for step in range(int(sys.argv[1])):
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(data), target).backward()
    optimizer.step()
weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print(repr(time.monotonic()), hashlib.sha256(weights).hexdigest(), flush=True)
"""
STEPS = 4000


def start_loop(steps: int = STEPS) -> subprocess.Popen[str]:
    job = subprocess.Popen(["taskset", "-c", "0", sys.executable, "-c", LOOP, str(steps)],
                           stdout=subprocess.PIPE, text=True, cwd="/", start_new_session=True)
    assert job.stdout is not None and job.stdout.readline() == "ready\n"
    return job


def finish(job: subprocess.Popen[str]) -> tuple[float, str]:
    output = job.communicate(timeout=600)[0]
    assert job.returncode == 0, output
    ended, digest = output.split()
    return float(ended), digest


@pytest.fixture(scope="module")
def untouched_digest() -> str:
    return finish(start_loop())[1]


def stop(job: subprocess.Popen[str]) -> None:
    if job.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(job.pid, 9)
        job.wait(10)


def test_a_pinned_torch_loop_runs_the_queued_code_and_computes_the_same(
        tmp_path: Path, untouched_digest: str) -> None:
    marker = tmp_path / "ran"
    job = start_loop()
    try:
        inject(Target.of(job.pid),
               f"import time; open({str(marker)!r}, 'w').write(repr(time.monotonic()))")
        ended, digest = finish(job)
    finally:
        stop(job)
    ran = float(wait_until(marker.read_text, 10))
    assert ran < ended, "the code ran only once the loop had ended"
    assert digest == untouched_digest, "the attach changed the job's results"


KILLS = 20
LONG_STEPS = 3 * STEPS  # long enough for most of the kills, on any machine


def test_killing_the_agent_during_the_injection_leaves_the_loop_computing_the_same() -> None:
    """20 agents, each killed (SIGKILL) at a random instant from the start of its
    injection to a little past its usual end, one after the other into a long loop
    (and into another while kills remain once it has ended): it is never left stopped
    or traced, and its weights are bit-identical to an untouched run's."""
    untouched = finish(start_loop(LONG_STEPS))[1]
    agent = injecting_agent
    rng = random.Random(31)
    harmed: list[str] = []
    duration, kills, jobs = 0.0, 0, 0
    while kills < KILLS:
        job = start_loop(LONG_STEPS)
        jobs += 1
        try:
            if duration == 0.0:  # the injection's usual length, uncut
                whole = agent(job)
                began = time.monotonic()
                assert whole.wait(60) == 0
                duration = time.monotonic() - began
            while kills < KILLS and job.poll() is None:
                delay = rng.uniform(0.0, duration * 1.2)
                side = agent(job)
                time.sleep(delay)
                side.kill()
                side.wait(10)
                if side.stdout is not None:
                    side.stdout.close()
                kills += 1
                problem = left_stopped_or_traced(job.pid)
                if problem is not None:
                    harmed.append(f"kill {kills} (at {delay:.2f} s): {problem}")
            _, digest = finish(job)
        finally:
            stop(job)
        if digest != untouched:
            harmed.append(f"job {jobs}: computed something else")
    assert not harmed, (f"{KILLS} kills (an injection takes {duration:.2f} s here):\n"
                        + "\n".join(harmed))
