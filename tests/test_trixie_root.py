"""Real Python 3.13 jobs, run through chroot in a Debian trixie root (scripts/
build-python-roots), reached from the agent's own Python: the ptrace injector finds
the job's own libc and libpython through its root, the probe comes up and the job
computes on; gdb, where it is the injector, reads the job's files too, and refuses
to call into the job where it would read others. A main thread in a lock wait (3.13's
parking lot) runs the queued code while it waits, and every wait ends when it would
have, with the same result. Each test skips, saying why, where the root is absent
(.ci/run builds it before the tests)."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from benchmarks import reach
from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import InjectionFailed, InjectionNotNow
from dlprof_agent.probe_link.client import ProbeClient
from dlprof_agent.probe_link.connect import NoProbe, ProbeOptions, try_connect
from dlprof_agent.reach import gdb
from dlprof_agent.reach import inject as injector
from dlprof_agent.reach.call_plan import plan_calls
from dlprof_agent.reach.gdb import inject_with_gdb
from dlprof_agent.reach.inject import inject
from dlprof_agent.reach.mapped_files import read_memory
from dlprof_agent.reach.runtime import find_python_runtime
from dlprof_agent.reach.shutdown import shutting_down
from tests.conftest import agent_env, force_gdb, gdb_refusal
from tests.helpers import wait_until
from tests.test_main_thread_waits import RESULTS, WAITS
from tests.test_pure_python_loop import (
    LOOP,
    LOOP_BESIDE_A_NATIVE_THREAD,
    StartLoop,
    check_kills_leave_the_loop_computing,
    check_the_queued_code_runs_in_the_loop,
    finish,
    left_stopped_or_traced,
    start_loop,
    stop,
)

REPO = Path(__file__).resolve().parents[1]
CHROOT = shutil.which("chroot") or "/usr/sbin/chroot"
ROOTS = Path(os.environ.get("DLPROF_PYTHON_ROOTS", REPO / "build" / "roots"))
TRIXIE_ROOT = ROOTS / "trixie"


def _elf_machine(path: Path) -> int | None:
    """The CPU an ELF file is built for (e_machine); None where it cannot be read."""
    try:
        with path.open("rb") as file:
            header = file.read(20)
    except OSError:
        return None
    return int.from_bytes(header[18:20], "little") if header[:4] == b"\x7fELF" else None


def root_problem(suite: str, python: tuple[int, int]) -> str | None:
    """Why jobs cannot run on Debian ``suite``'s Python ``python`` here; None if they can."""
    if _elf_machine(ROOTS / suite / "usr" / "bin" / "python3") not in (
            None, _elf_machine(Path(sys.executable))):
        return f"the {suite} root at {ROOTS / suite} is built for another CPU than this one"
    if os.geteuid() != 0:
        return "running a job in a Debian root needs chroot, as root"
    if sys.version_info[:2] == python:
        return (f"the agent itself runs {python[0]}.{python[1]}: the job would not be in "
                "another root's Python")
    if reach.root_python_version(ROOTS / suite) is None:
        return (f"no Debian {suite} root with python3 at {ROOTS / suite}: build it with "
                f"scripts/build-python-roots --suite {suite} (as root)")
    return None


_PROBLEM = root_problem("trixie", (3, 13))
pytestmark = [pytest.mark.slow,  # real jobs in a Debian root
              # one worker: its fixture copies the agent's package into the root
              pytest.mark.xdist_group("python-roots"),
              pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")]


def ready(process: subprocess.Popen[str]) -> subprocess.Popen[str]:
    """``process`` once it has printed "ready" (lines before it are noise: torch's UCX
    says on stdout that it cannot read /proc, which the root does not mount)."""
    assert process.stdout is not None
    for line in process.stdout:
        if line == "ready\n":
            return process
    raise AssertionError(f"the job ended before it was ready: {process.wait()}")


def kill_all(started: list[subprocess.Popen[str]]) -> None:
    for process in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate(timeout=30)


Job = Callable[..., "subprocess.Popen[str]"]

# Counts on, printing each thousandth round: a job that computes prints more lines.
_COUNTS = ("import time\nprint('ready', flush=True)\ni = 0\nwhile True:\n"
           "    i += 1\n    time.sleep(0.001)\n    if i % 100 == 0:\n"
           "        print(i, flush=True)\n")


@pytest.fixture(scope="module")
def trixie_root() -> Path:
    reach.show_package_in(TRIXIE_ROOT)
    return TRIXIE_ROOT


@pytest.fixture
def job(trixie_root: Path) -> Iterator[Job]:
    started: list[subprocess.Popen[str]] = []

    def start(script: str, *args: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [CHROOT, str(trixie_root.resolve()), "python3", "-c", script, *args],
            cwd=trixie_root, env={"PATH": "/usr/bin:/bin"}, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        started.append(process)
        return ready(process)

    yield start
    kill_all(started)


def _computes_on(process: subprocess.Popen[str]) -> None:
    """The job is alive and still prints its count, higher than before."""
    assert process.stdout is not None
    assert process.poll() is None, f"the job died: {process.returncode}"
    first = int(process.stdout.readline())
    later = int(process.stdout.readline())
    assert later > first
    assert process.poll() is None


def _connect(pid: int) -> ProbeClient | None:
    try:
        return try_connect(Target.of(pid), ProbeOptions(), 1.0, 0.0)
    except NoProbe:
        return None


def _reach(pid: int) -> ProbeClient:
    client = wait_until(lambda: _connect(pid), 60, interval=1.0,
                        what=f"the probe in the 3.13 job {pid}")
    assert client is not None
    return client


def test_the_ptrace_injector_calls_the_jobs_own_libc(job: Job) -> None:
    process = job(_COUNTS)
    runtime = find_python_runtime(Target.of(process.pid))
    assert runtime is not None and runtime.version == (3, 13)
    calls = plan_calls(Target.of(process.pid), runtime)
    assert calls is not None, "libc's mmap found through the job's root, not gdb's turn"
    # 3.13's debug offsets place the words that say its interpreter runs (``shutdown``)
    assert calls.life is not None and calls.life.interpreters is not None
    assert not shutting_down(calls.life, functools.partial(read_memory, Target.of(process.pid)))
    client = _reach(process.pid)
    try:
        assert client.snapshot() is not None
    finally:
        client.stop()
    _computes_on(process)


def _needs_gdb() -> None:
    refused = gdb_refusal()
    if refused is not None:
        pytest.skip(refused)


def test_gdb_reads_the_jobs_own_files_and_the_job_lives(
        job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_gdb()
    process = job(_COUNTS)
    monkeypatch.setattr(injector, "plan_calls", lambda target, runtime: None)  # gdb's turn
    inject(Target.of(process.pid), "print('queued by gdb', flush=True)")
    assert process.stdout is not None
    lines = process.stdout
    assert wait_until(lambda: lines.readline() == "queued by gdb\n", 30,
                      what="the job to print from the code gdb queued")
    _computes_on(process)


def test_gdb_refuses_to_call_an_address_other_than_the_jobs(
        job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused before any call, so it runs wherever gdb does, AMX included."""
    force_gdb(monkeypatch)
    process = job(_COUNTS)
    runtime = find_python_runtime(Target.of(process.pid))
    checked = gdb.checked_addresses(Target.of(process.pid), runtime)
    assert set(checked) == {"mmap", "Py_AddPendingCall", "PyRun_SimpleString"}
    # As if gdb had read another libc than the job's: its mmap is not where the job's is.
    monkeypatch.setattr(gdb, "checked_addresses",
                        lambda target, runtime: {**checked, "mmap": checked["mmap"] + 16})
    with pytest.raises(InjectionFailed, match="gdb reads another file for mmap"):
        inject_with_gdb(Target.of(process.pid), "print('must not run', flush=True)", 10.0, runtime)
    _computes_on(process)


# Starts a job whose main thread waits in one way (``WAITS``) for so many seconds
StartWaiting = Callable[[str, float], "subprocess.Popen[str]"]


def in_its_wait(process: subprocess.Popen[str]) -> subprocess.Popen[str]:
    wait_until(lambda: Path(f"/proc/{process.pid}/syscall").read_text().split()[0]
               not in ("running", "-1"), 10, what="the main thread to wait")
    return process


def check_the_queued_code_runs_while_waiting(start: StartWaiting, root: Path,
                                             kind: str) -> None:
    """A job in ``root`` whose main thread waits in ``kind`` runs the code queued
    meanwhile while it waits (after it, for a sleep); the wait ends when it would
    have, with the same result."""
    seconds = 8.0
    marker = f"/tmp/dlprof-waits-{os.getpid()}-{kind}"  # as the job sees it
    process = in_its_wait(start(kind, seconds))
    try:
        inject(Target.of(process.pid),
               f"import time; open({marker!r}, 'w').write(repr(time.monotonic()))")
        output = process.communicate(timeout=seconds + 60)[0]
        assert process.returncode == 0, output
        began, ended, result = output.split(maxsplit=2)
        ran = float(wait_until((root / marker.lstrip("/")).read_text, 10))
    finally:
        with contextlib.suppress(FileNotFoundError):
            (root / marker.lstrip("/")).unlink()
    assert result.strip() == RESULTS[kind], "the wait returned something else"
    assert float(ended) - float(began) >= seconds, "the wait ended early"
    if kind == "time.sleep":
        assert ran >= float(began) + seconds, "a sleep is never cut short"
    else:
        assert ran < float(began) + seconds, "a lock wait runs the queued code while it waits"


def check_kills_leave_the_wait_as_it_was(start: StartWaiting, kind: str) -> None:
    """Kills (SIGKILL) of the agent at random instants of an injection into a job
    whose main thread waits in the parking lot: each wait ends when it would have,
    with the same result, the job never left stopped or traced."""
    seconds = 2.5
    attempt = ("import sys\n"
               "from dlprof_agent.collectors.target import Target\n"
               "from dlprof_agent.reach.inject import inject\n"
               "inject(Target.of(int(sys.argv[1])), 'pass')\n")

    def agent(process: subprocess.Popen[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", attempt, str(process.pid)],
                                env=agent_env(), cwd="/", stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)

    process = in_its_wait(start(kind, seconds))
    began_at = time.monotonic()
    assert agent(process).wait(60) == 0
    whole = time.monotonic() - began_at  # the agent's start and one injection
    process.communicate(timeout=seconds + 60)
    rng = random.Random(313)
    harmed = []
    for number in range(5):
        process = in_its_wait(start(kind, seconds))
        side = agent(process)
        time.sleep(rng.uniform(0.0, whole * 1.1))
        side.kill()
        side.wait(10)
        state = Path(f"/proc/{process.pid}/stat").read_text().rpartition(")")[2].split()[0]
        tracer = next(line.split()[1] for line in
                      Path(f"/proc/{process.pid}/status").read_text().splitlines()
                      if line.startswith("TracerPid:"))
        output = process.communicate(timeout=seconds + 60)[0]
        began, ended, result = output.split(maxsplit=2)
        if state in ("t", "T") or tracer != "0":
            harmed.append(f"try {number}: left in state {state}, traced by {tracer}")
        if (process.returncode != 0 or result.strip() != RESULTS[kind]
                or float(ended) - float(began) < seconds):
            harmed.append(f"try {number}: the wait returned {result.strip()} after "
                          f"{float(ended) - float(began):.2f} s, exit {process.returncode}")
    assert not harmed, "\n".join(harmed)


@pytest.mark.parametrize("kind", sorted(RESULTS))
def test_the_code_queued_in_a_waiting_3_13_main_thread_runs(
        job: Job, trixie_root: Path, kind: str) -> None:
    check_the_queued_code_runs_while_waiting(
        lambda kind, seconds: job(WAITS, kind, str(seconds)), trixie_root, kind)


@pytest.mark.parametrize("kind", ["join", "lock.acquire", "queue.get"])
def test_killing_the_agent_while_it_ends_a_3_13_wait_leaves_the_wait_as_it_was(
        job: Job, kind: str) -> None:
    check_kills_leave_the_wait_as_it_was(
        lambda kind, seconds: job(WAITS, kind, str(seconds)), kind)


# A busy main thread on 3.13: borrowed with the job's other threads held and the
# pending-call mutex free (``reach/pending_mutex.py``)
BUSY_LOOPS = {"alone": LOOP, "beside a native thread": LOOP_BESIDE_A_NATIVE_THREAD}


def _loop_in(root: Path, script: str) -> StartLoop:
    return functools.partial(start_loop, python=(CHROOT, str(root.resolve()), "python3"),
                             script=script, env={"PATH": "/usr/bin:/bin"}, cwd=str(root))


@pytest.mark.parametrize("kind", sorted(BUSY_LOOPS))
def test_a_busy_3_13_main_thread_runs_the_queued_code_and_computes_the_same(
        trixie_root: Path, kind: str) -> None:
    marker = f"/tmp/dlprof-busy-{os.getpid()}-{kind.replace(' ', '-')}"  # as the job sees it
    written = trixie_root / marker.lstrip("/")
    try:
        check_the_queued_code_runs_in_the_loop(_loop_in(trixie_root, BUSY_LOOPS[kind]),
                                               marker, written)
    finally:
        written.unlink(missing_ok=True)


@pytest.mark.parametrize("kind", sorted(BUSY_LOOPS))
def test_killing_the_agent_while_it_borrows_a_busy_3_13_main_thread_leaves_it_computing(
        trixie_root: Path, kind: str) -> None:
    check_kills_leave_the_loop_computing(_loop_in(trixie_root, BUSY_LOOPS[kind]))


def test_a_busy_3_13_main_thread_is_not_borrowed_while_the_pending_call_mutex_is_held(
        trixie_root: Path) -> None:
    """The mutex's byte set in the job, as another thread holding it would: no call is
    made, and the injector says so; freed again, the probe's code is queued and runs."""
    rounds = 200
    job = _loop_in(trixie_root, LOOP)(rounds)
    marker = f"/tmp/dlprof-mutex-{os.getpid()}"  # as the job sees it
    written = trixie_root / marker.lstrip("/")
    try:
        runtime = find_python_runtime(Target.of(job.pid))
        calls = plan_calls(Target.of(job.pid), runtime) if runtime is not None else None
        assert calls is not None and calls.busy_stops is not None
        mutex = calls.busy_stops.pending_mutex
        assert mutex is not None, "the mutex of trixie's 3.13 was not found"
        with open(f"/proc/{job.pid}/mem", "r+b", buffering=0) as memory:
            memory.seek(mutex)
            assert memory.read(1) == b"\0"
            memory.seek(mutex)
            memory.write(b"\1")
            try:
                with pytest.raises(InjectionNotNow, match="reached no safe point"):
                    inject(Target.of(job.pid),
                           f"open({marker!r}, 'w').write('early')", wait_seconds=2.0)
            finally:
                memory.seek(mutex)
                memory.write(b"\0")
        assert left_stopped_or_traced(job.pid) is None
        assert not written.exists()
        inject(Target.of(job.pid), f"open({marker!r}, 'w').write('ran')")
        assert wait_until(written.read_text, 30) == "ran"
        assert job.poll() is None, "the code ran only once the loop had ended"
        assert finish(job) == f"rounds {rounds}"
    finally:
        stop(job)
        written.unlink(missing_ok=True)
