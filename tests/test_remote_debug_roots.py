"""Real Python 3.14 jobs, run through chroot in a Debian sid root (scripts/
build-python-roots), reached from the agent's own Python with PEP 768's protocol done
by hand (reach/remote_debug.py): the debug offsets of the real binary, the probe
coming up and counting steps, the opt-out leaving the job untouched, a sleeping main
thread taking the probe when its sleep returns, and a script never taken withdrawn. A
main thread in a lock wait gets the probe while it waits instead (the ptrace
injector's pending call, the wait ended with EINTR), each wait ending as it would
have, kills of the agent meanwhile included.
Each test skips, saying why, where the root is absent (.ci/run builds it before the tests)."""

from __future__ import annotations

import functools
import os
import signal
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from benchmarks import reach
from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import InjectionRefused
from dlprof_agent.probe_link.client import ProbeClient
from dlprof_agent.probe_link.connect import NoProbe, ProbeOptions, try_connect
from dlprof_agent.reach.inject import inject
from dlprof_agent.reach.mapped_files import read_memory
from dlprof_agent.reach.remote_debug import (
    QueuedRemoteExec,
    find_remote_debug,
    inject_with_remote_debug,
)
from dlprof_agent.reach.runtime import find_python_runtime
from dlprof_agent.reach.shutdown import life_words, shutting_down
from tests.helpers import wait_until
from tests.test_main_thread_waits import RESULTS, WAITS
from tests.test_trixie_root import (
    CHROOT,
    ROOTS,
    check_kills_leave_the_wait_as_it_was,
    check_the_queued_code_runs_while_waiting,
    kill_all,
    ready,
    root_problem,
)

SID_ROOT = ROOTS / "sid"


_PROBLEM = root_problem("sid", (3, 14))
pytestmark = [pytest.mark.slow,  # real jobs in a Debian root
              # one worker: its fixture copies the agent's package into the root
              pytest.mark.xdist_group("python-roots"),
              pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")]

Job = Callable[..., "subprocess.Popen[str]"]


@pytest.fixture(scope="module")
def sid_root() -> Path:
    reach.show_package_in(SID_ROOT)
    return SID_ROOT


@pytest.fixture
def job(sid_root: Path) -> Iterator[Job]:
    started: list[subprocess.Popen[str]] = []

    def start(script: str, *, args: tuple[str, ...] = (), env: dict[str, str] | None = None,
              argv: tuple[str, ...] = ()) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [CHROOT, str(sid_root.resolve()), "python3", *args, "-c", script, *argv],
            cwd=sid_root, env={"PATH": "/usr/bin:/bin", **(env or {})},
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True)
        started.append(process)
        return ready(process)

    yield start
    kill_all(started)



_BUSY = "print('ready', flush=True)\nwhile True:\n    sum(range(1000))\n"
# The main thread waits for a line on stdin; then runs Python again, then waits on.
_WAITS_FOR_A_LINE = ("import sys, time\nprint('ready', flush=True)\nsys.stdin.readline()\n"
                     "print('woke', flush=True)\ntime.sleep(3600)\n")


def _waits_in_read(pid: int) -> bool:
    """The job's main thread is blocked in read(2) (syscall 0 on x86-64): past the
    last bytecode before its wait, so a script handed to it now waits too."""
    try:
        with open(f"/proc/{pid}/syscall") as file:
            return file.read().split()[0] == "0"
    except (OSError, IndexError):
        return False


def _bootstrap_folders(root: Path) -> list[str]:
    return [name for name in os.listdir(root / "tmp") if name.startswith("dlprof-bootstrap-")]


def test_the_debug_offsets_of_a_real_3_14_job(job: Job) -> None:
    process = job(_BUSY)
    runtime = find_python_runtime(Target.of(process.pid))
    assert runtime is not None and runtime.version == (3, 14)
    target = find_remote_debug(Target.of(process.pid), runtime)
    assert target is not None, "3.14's table read from its _PyRuntime"
    offsets = target.offsets
    with open(f"/proc/{process.pid}/mem", "rb", buffering=0) as memory:
        def pointer(address: int) -> int:
            memory.seek(address)
            value: int = struct.unpack("<Q", memory.read(8))[0]
            return value
        interpreter = pointer(target.runtime_address + offsets.interpreters_head)
        main = pointer(interpreter + offsets.threads_main)
        # The main thread's state names the job's own first thread: the layout is right.
        assert pointer(main + offsets.native_thread_id) == process.pid
    # The words that say its interpreter runs (``shutdown``), from the same table
    words = life_words(runtime.version, target.runtime_address,
                       functools.partial(read_memory, Target.of(process.pid)))
    assert words is not None
    assert words.interpreters == target.runtime_address + offsets.interpreters_head
    assert not shutting_down(words, functools.partial(read_memory, Target.of(process.pid)))


def test_the_probe_comes_up_in_a_3_14_job(job: Job) -> None:
    process = job(_BUSY)
    client = _reach(process.pid, 60)
    try:
        assert client.snapshot() is not None
    finally:
        client.stop()
    assert process.poll() is None, "the job runs on"


def _connect(pid: int) -> ProbeClient | None:
    try:
        return try_connect(Target.of(pid), ProbeOptions(), 1.0, 0.0)
    except NoProbe:
        return None


def _reach(pid: int, seconds: float) -> ProbeClient:
    client = wait_until(lambda: _connect(pid), seconds, interval=1.0,
                        what=f"the probe in the 3.14 job {pid}")
    assert client is not None
    return client


_TORCH_STEPS = """
import torch
torch.set_num_threads(1)
model = torch.nn.Linear(64, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data, target = torch.randn(32, 64), torch.randint(0, 4, (32,))
print("ready", flush=True)
while True:
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(data), target).backward()
    optimizer.step()
"""


def test_the_steps_of_a_3_14_torch_job_are_read(job: Job, sid_root: Path) -> None:
    if not list((sid_root / "usr" / "lib" / "python3" / "dist-packages").glob("torch")):
        pytest.skip("no python3-torch in the sid root: scripts/build-python-roots --torch")
    process = job(_TORCH_STEPS)
    client = _reach(process.pid, 90)
    try:
        steps: int = wait_until(lambda: sum(count for _, count in client.snapshot().steps),
                                60, interval=0.5, what="steps counted by the probe")
        assert steps > 0
    finally:
        client.stop()


@pytest.mark.parametrize(("env", "args", "says"), [
    ({"PYTHON_DISABLE_REMOTE_DEBUG": "1"}, (), "PYTHON_DISABLE_REMOTE_DEBUG is set"),
    ({}, ("-X", "disable-remote-debug"), "-X disable-remote-debug"),
])
def test_a_job_that_opted_out_is_left_untouched(job: Job, sid_root: Path, env: dict[str, str],
                                                 args: tuple[str, ...], says: str) -> None:
    process = job(_WAITS_FOR_A_LINE, args=args, env=env)
    before = _bootstrap_folders(sid_root)
    with pytest.raises(InjectionRefused) as refusal:
        inject(Target.of(process.pid), "open('/tmp/should-not-run', 'w')")
    assert says in str(refusal.value)
    assert "start it without PYTHON_DISABLE_REMOTE_DEBUG" in (refusal.value.hint or "")
    # A subset: inject first clears what killed agents left (``remove_stale_files``)
    assert set(_bootstrap_folders(sid_root)) <= set(before), "no script was written for it"
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write("go\n")
    process.stdin.flush()
    assert process.stdout.readline() == "woke\n", "the job goes on as before"
    assert not (sid_root / "tmp" / "should-not-run").exists()


def test_a_sleeping_main_thread_takes_the_probe_when_its_sleep_returns(sid_root: Path) -> None:
    row = reach.measure("main in time.sleep(6) in a loop", 60.0, sid_root)
    assert row.came_up, row.why
    assert row.tries == 1, "queued by the first try, run when the sleep returned"


def test_a_script_the_job_never_took_is_withdrawn_when_the_agent_leaves(
        job: Job, sid_root: Path) -> None:
    process = job(_WAITS_FOR_A_LINE)
    wait_until(lambda: _waits_in_read(process.pid), 30, what="the main thread in its read")
    marker = sid_root / "tmp" / f"ran-{process.pid}"
    runtime = find_python_runtime(Target.of(process.pid))
    assert runtime is not None
    target = find_remote_debug(Target.of(process.pid), runtime)
    assert target is not None
    queued = inject_with_remote_debug(Target.of(process.pid),
                                      f"open({str(marker)[len(str(sid_root)):]!r}, "
                                      "'w').close()", target)
    assert isinstance(queued, QueuedRemoteExec)
    assert queued.state() == "queued", "the main thread waits: nothing ran yet"
    queued.withdraw()  # what the agent does at exit
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write("go\n")
    process.stdin.flush()
    assert process.stdout.readline() == "woke\n"
    os.killpg(process.pid, signal.SIGKILL)
    _, stderr = process.communicate(timeout=30)
    assert not marker.exists(), "a withdrawn script never runs"
    assert "debugger script" not in stderr, stderr


def test_a_waiting_main_thread_runs_the_script_when_its_wait_returns(
        job: Job, sid_root: Path) -> None:
    process = job(_WAITS_FOR_A_LINE)
    wait_until(lambda: _waits_in_read(process.pid), 30, what="the main thread in its read")
    marker = sid_root / "tmp" / f"ran-{process.pid}"
    queued = inject(Target.of(process.pid),
                    f"open({str(marker)[len(str(sid_root)):]!r}, 'w').close()")
    assert isinstance(queued, QueuedRemoteExec)
    # While it waits, the script stays queued and its file stays (watched every second,
    # it once went at the first look, before the flag was even set).
    watched_until = time.monotonic() + 2.5
    while time.monotonic() < watched_until:
        assert queued.state() == "queued"
        assert _bootstrap_folders(sid_root), "the script's file is kept while queued"
        time.sleep(0.1)
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write("go\n")
    process.stdin.flush()
    assert process.stdout.readline() == "woke\n"
    wait_until(marker.exists, 30, what="the script run once the wait returned")
    wait_until(lambda: queued.state() == "ran", 10, what="the flag cleared by the job")


@pytest.mark.parametrize("kind", sorted(RESULTS))
def test_a_waiting_3_14_main_thread_runs_the_queued_code_while_it_waits(
        job: Job, sid_root: Path, kind: str) -> None:
    """In a lock wait: at once, the wait ended with EINTR and waited again; in a
    sleep: PEP 768's script, when the sleep returns."""
    check_the_queued_code_runs_while_waiting(
        lambda kind, seconds: job(WAITS, argv=(kind, str(seconds))), sid_root, kind)


@pytest.mark.parametrize("kind", ["join", "lock.acquire", "queue.get"])
def test_killing_the_agent_while_it_ends_a_3_14_wait_leaves_the_wait_as_it_was(
        job: Job, kind: str) -> None:
    check_kills_leave_the_wait_as_it_was(
        lambda kind, seconds: job(WAITS, argv=(kind, str(seconds))), kind)
