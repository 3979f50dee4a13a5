"""A pure-Python loop pinned to one CPU, that never enters the kernel, gets the probe:
the injector stops its main thread in the eval loop's own code (``reach/safe_point.py``).
It computes the same results with and without the attach, and killing the agent at
any instant of the injection leaves it computing them."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from dlprof_agent.collectors.target import Target
from dlprof_agent.reach.inject import inject
from tests.conftest import agent_env
from tests.helpers import NO_OWN_INJECTOR, OWN_INJECTOR, wait_until

pytestmark = [
    pytest.mark.slow,  # real jobs, computing for seconds each
    pytest.mark.skipif(not OWN_INJECTOR, reason=NO_OWN_INJECTOR),
    pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset"),
]

# Sums 0..999999 in a while loop sys.argv[1] times, each round checked against the
# closed form; no system call from "ready" to the end. Prints the rounds done.
LOOP = """
import sys
def rounds(count):
    done = 0
    while done < count:
        i, total = 0, 0
        while i < 1000000:
            total += i
            i += 1
        if total != 499999500000:
            return f"round {done} summed to {total}"
        done += 1
    return f"rounds {done}"
count = int(sys.argv[1])
print("ready", flush=True)
print(rounds(count), flush=True)
"""
# The same loop, beside a thread hashing in C without the GIL, each digest checked: a
# busy 3.13 main thread is borrowed with such threads stopped until its call is queued.
LOOP_BESIDE_A_NATIVE_THREAD = """
import hashlib, os, threading
DATA = bytes(range(256)) * 4096
EXPECTED = hashlib.sha256(DATA).hexdigest()
def hashing():
    while True:
        if hashlib.sha256(DATA).hexdigest() != EXPECTED:
            print("a digest differed", flush=True)
            os._exit(3)
threading.Thread(target=hashing, daemon=True).start()
""" + LOOP
ROUNDS = 30
# An agent that says when its injection begins (after its imports), and ends with it
AGENT = ("import sys\n"
         "from dlprof_agent.collectors.target import Target\n"
         "from dlprof_agent.reach.inject import inject\n"
         "print('injecting', flush=True)\n"
         "inject(Target.of(int(sys.argv[1])), 'pass')\n")

# Starts the loop for so many rounds, and returns it once it is ready
StartLoop = Callable[[int], "subprocess.Popen[str]"]


def start_loop(rounds: int = ROUNDS, *, python: Sequence[str] = (sys.executable,),
               script: str = LOOP, env: dict[str, str] | None = None,
               cwd: str = "/") -> subprocess.Popen[str]:
    """``script`` run by ``python`` (a chroot's, say), pinned to CPU 0."""
    job = subprocess.Popen(["taskset", "-c", "0", *python, "-c", script, str(rounds)],
                           stdout=subprocess.PIPE, text=True, cwd=cwd, env=env,
                           start_new_session=True)
    assert job.stdout is not None and job.stdout.readline() == "ready\n"
    return job


def finish(job: subprocess.Popen[str]) -> str:
    """What the loop printed once it ended: "rounds N" when every round was right."""
    output = job.communicate(timeout=600)[0]
    assert job.returncode == 0, output
    return output.strip()


def stop(job: subprocess.Popen[str]) -> None:
    if job.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, 9)
        job.wait(10)


def left_stopped_or_traced(pid: int) -> str | None:
    """A thread of ``pid`` left stopped or traced, said; None when all run free."""
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # it ended
            state = (task / "stat").read_text().rpartition(")")[2].split()[0]
            tracer = next(line.split()[1] for line in (task / "status").read_text()
                          .splitlines() if line.startswith("TracerPid:"))
            if state in ("t", "T"):
                return f"thread {task.name} left stopped"
            if tracer != "0":
                return f"thread {task.name} left traced by {tracer}"
    return None


def check_the_queued_code_runs_in_the_loop(start: StartLoop, marker: str,
                                           written: Path) -> None:
    """Code queued in a loop that ``start`` runs writes ``marker`` (the path as the job
    sees it, ``written`` as this process does) while the loop runs, and the loop's
    threads are left free and compute every round right."""
    job = start(ROUNDS)
    try:
        queued = inject(Target.of(job.pid), f"open({marker!r}, 'w').write('ran')")
        assert queued is not None
        wait_until(written.exists, 30)
        assert job.poll() is None, "the code ran only once the loop had ended"
        assert queued.state() == "ran"
        assert left_stopped_or_traced(job.pid) is None
        assert finish(job) == f"rounds {ROUNDS}"
    finally:
        stop(job)


def injecting_agent(job: subprocess.Popen[str]) -> subprocess.Popen[str]:
    """An agent injecting into ``job``, returned once its injection begins."""
    started = subprocess.Popen([sys.executable, "-c", AGENT, str(job.pid)], env=agent_env(),
                               cwd="/", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, start_new_session=True)
    assert started.stdout is not None and started.stdout.readline() == "injecting\n"
    return started


def check_kills_leave_the_loop_computing(start: StartLoop) -> None:
    """20 agents, each killed (SIGKILL) at a random instant from the start of its
    injection to a little past its usual end: the loop is never left stopped or traced,
    and finishes every round right."""
    agent = injecting_agent
    job = start(ROUNDS)
    began = time.monotonic()
    whole = agent(job)
    injecting = time.monotonic()
    assert whole.wait(60) == 0
    duration = time.monotonic() - injecting
    finish(job)
    loop_seconds = time.monotonic() - began
    # Each job outlasts the agent's start, its injection and the kill by a second
    rounds = max(10, int(ROUNDS * (injecting - began + duration * 1.2 + 1.0)
                         / loop_seconds) + 1)
    rng = random.Random(24)
    tries, harmed = 20, []
    for number in range(tries):
        job = start(rounds)
        try:
            delay = rng.uniform(0.0, duration * 1.2)
            side = agent(job)
            time.sleep(delay)
            side.kill()
            side.wait(10)
            if side.stdout is not None:
                side.stdout.close()
            problem = left_stopped_or_traced(job.pid) if job.poll() is None else None
            result = finish(job)
        finally:
            stop(job)
        if problem is not None:
            harmed.append(f"try {number} (killed at {delay:.2f} s): {problem}")
        if result != f"rounds {rounds}":
            harmed.append(f"try {number} (killed at {delay:.2f} s): {result}")
    assert not harmed, (f"{len(harmed)} of {tries} kills harmed the loop (an injection "
                        f"takes {duration:.2f} s here):\n"
                        + "\n".join(harmed))


def test_a_pinned_pure_python_loop_runs_the_queued_code_and_computes_the_same(
        tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    check_the_queued_code_runs_in_the_loop(start_loop, str(marker), marker)


def test_killing_the_agent_during_the_injection_leaves_the_loop_computing_the_same() -> None:
    check_kills_leave_the_loop_computing(start_loop)
