"""A job whose main thread waits gets the probe: in CPython's lock waits (``join()``,
``lock.acquire``, ``Event.wait``, ``queue.get``) the injector ends the wait with
EINTR, the interpreter runs the queued code and waits again; other waits
(``time.sleep``) only queue it, and it runs when the wait returns. Every wait still
ends when it would have, with the same result, and killing the agent at any instant
of the injection leaves the job to finish as it would have. Real jobs on this
machine's Python."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlprof_agent.collectors.target import Target
from dlprof_agent.reach.inject import inject
from tests.conftest import agent_env
from tests.helpers import NO_OWN_INJECTOR, OWN_INJECTOR, wait_until

pytestmark = [
    pytest.mark.slow,  # real jobs that wait for seconds
    pytest.mark.skipif(not OWN_INJECTOR, reason=NO_OWN_INJECTOR),
]

# The main thread waits sys.argv[2] seconds in one way, then prints how long it
# waited and what the wait returned; the clock is the one the agent's marker uses.
WAITS = """
import queue, sys, threading, time
kind, seconds = sys.argv[1], float(sys.argv[2])
print("ready", flush=True)
began = time.monotonic()
if kind == "join":
    worker = threading.Thread(target=time.sleep, args=(seconds,))
    worker.start()
    result = worker.join()
elif kind == "lock.acquire":
    lock = threading.Lock()
    lock.acquire()
    threading.Timer(seconds, lock.release).start()
    result = lock.acquire()
elif kind == "lock.acquire(timeout)":
    lock = threading.Lock()
    lock.acquire()
    result = lock.acquire(timeout=seconds)
elif kind == "Event.wait":
    result = threading.Event().wait(seconds)
elif kind == "queue.get":
    items = queue.Queue()
    threading.Timer(seconds, items.put, ("item",)).start()
    result = items.get()
elif kind == "time.sleep":
    result = time.sleep(seconds)
ended = time.monotonic()
print(f"{began!r} {ended!r} {result!r}", flush=True)
"""
RESULTS = {"join": "None", "lock.acquire": "True", "lock.acquire(timeout)": "False",
           "Event.wait": "False", "queue.get": "'item'", "time.sleep": "None"}
LOCK_WAITS = sorted(set(RESULTS) - {"time.sleep"})
KILLS = 20  # of the agent, at random instants of an injection, per kind of wait


def start_waiting(kind: str, seconds: float) -> subprocess.Popen[str]:
    job = subprocess.Popen([sys.executable, "-c", WAITS, kind, str(seconds)],
                           stdout=subprocess.PIPE, text=True, cwd="/",
                           start_new_session=True)
    assert job.stdout is not None and job.stdout.readline() == "ready\n"
    # In its wait: the main thread sleeps in a system call.
    wait_until(lambda: Path(f"/proc/{job.pid}/syscall").read_text().split()[0]
               not in ("running", "-1"), 10, what="the main thread to wait")
    return job


def finished(job: subprocess.Popen[str], seconds: float) -> tuple[float, float, str]:
    """When the job's wait began and ended (its monotonic clock), and what it returned;
    its exit code is 0."""
    output = job.communicate(timeout=seconds + 60)[0]
    assert job.returncode == 0, output
    began, ended, result = output.split(maxsplit=2)
    return float(began), float(ended), result.strip()


def stop(job: subprocess.Popen[str]) -> None:
    if job.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(job.pid, 9)
        job.wait(10)


@pytest.mark.parametrize("kind", sorted(RESULTS))
def test_the_code_queued_in_a_waiting_main_thread_runs(tmp_path: Path, kind: str) -> None:
    seconds = 8.0
    marker = tmp_path / "ran"
    job = start_waiting(kind, seconds)
    try:
        inject(Target.of(job.pid),
               f"import time; open({str(marker)!r}, 'w').write(repr(time.monotonic()))")
        began, ended, result = finished(job, seconds)
    finally:
        stop(job)
    ran = float(wait_until(marker.read_text, 10))
    assert result == RESULTS[kind], "the wait returned something else"
    assert ended - began >= seconds, "the wait ended early"
    if kind == "time.sleep":
        # Between the sleep's return and the next line: at the first bytecode after it
        assert ran >= began + seconds, "a sleep is never cut short: the code runs after it"
    else:
        assert ran < began + seconds, "a lock wait runs the queued code while it waits"


@pytest.mark.parametrize("kind", sorted(RESULTS))
def test_killing_the_agent_during_the_injection_leaves_the_wait_as_it_was(
        tmp_path: Path, kind: str) -> None:
    """Kills (SIGKILL) of the agent at random instants of an injection into a job
    whose main thread waits, one job a kill, all waiting at once: each job ends its
    wait when it would have, with the same result, never stopped or traced meanwhile."""
    seconds = 2.5
    attempt = ("import sys\n"
               "from dlprof_agent.collectors.target import Target\n"
               "from dlprof_agent.reach.inject import inject\n"
               "inject(Target.of(int(sys.argv[1])), 'pass')\n")

    def agent(job: subprocess.Popen[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", attempt, str(job.pid)],
                                env=agent_env(), cwd="/", stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)

    job = start_waiting(kind, seconds)
    try:
        began_at = time.monotonic()
        assert agent(job).wait(60) == 0
        whole = time.monotonic() - began_at  # the agent's start and one injection
        finished(job, seconds)
    finally:
        stop(job)
    rng = random.Random(24)
    harmed = []
    # All the jobs wait at once, long enough for every kill to fall inside its wait.
    seconds = 5.0 + KILLS * whole * 1.5
    jobs = []
    try:
        for _ in range(KILLS):
            jobs.append(start_waiting(kind, seconds))
        states = []
        for job in jobs:
            side = agent(job)
            time.sleep(rng.uniform(0.0, whole * 1.1))
            side.kill()
            side.wait(10)
            state = Path(f"/proc/{job.pid}/stat").read_text().rpartition(")")[2].split()[0]
            tracer = next(line.split()[1] for line in
                          Path(f"/proc/{job.pid}/status").read_text().splitlines()
                          if line.startswith("TracerPid:"))
            states.append((state, tracer))
        for number, (job, (state, tracer)) in enumerate(zip(jobs, states, strict=True)):
            began, ended, result = finished(job, seconds)
            if state in ("t", "T") or tracer != "0":
                harmed.append(f"try {number}: left in state {state}, traced by {tracer}")
            if result != RESULTS[kind] or ended - began < seconds:
                harmed.append(f"try {number}: the wait returned {result} after "
                              f"{ended - began:.2f} s")
    finally:
        for job in jobs:
            stop(job)
    assert not harmed, "\n".join(harmed)
