"""The job outlives anything that happens to the agent's side during an injection, with
real jobs and a real gdb: the agent and its gdb killed together at random moments (as a
systemd stop, a cgroup kill or a container stop does), a job that holds the GIL for
longer than the agent waits, a job that exits meanwhile, code that raises, and the
files an interrupted injection could leave behind."""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.no_harm import kill_agent_side
from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import InjectionFailed, TargetNotFound
from dlprof_agent.probe.bootstrap import injection_code
from dlprof_agent.reach import bootstrap_files, pending
from dlprof_agent.reach import inject as inject_module
from dlprof_agent.reach.inject import inject
from tests.conftest import agent_env, force_gdb, gdb_refusal
from tests.helpers import NO_OWN_INJECTOR, OWN_INJECTOR, wait_until, without_eval_loop_stops

pytestmark = pytest.mark.skipif(
    hasattr(sys, "remote_exec") or not (OWN_INJECTOR or shutil.which("gdb")),
    reason="before Python 3.14 the agent injects itself on x86-64 and arm64, elsewhere with gdb")

# A stand-in for a training loop: each step computes in Python for sys.argv[2] seconds,
# holding the GIL (as data preparation or a checkpoint does), then waits in the kernel
# briefly (as a framework call that releases the GIL does); a worker thread waits for
# work meanwhile (as a framework's thread pool does). It publishes its step count.
TRAINING = """
import os, sys, threading, time
steps_file, hold = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
idle = threading.Lock()
idle.acquire()
threading.Thread(target=idle.acquire, daemon=True).start()
print("ready", flush=True)
step, published = 0, 0.0
while True:
    end = time.monotonic() + hold
    while time.monotonic() < end:
        pass
    sum(range(2000))
    time.sleep(0.002)
    step += 1
    if time.monotonic() - published > 0.05:
        with open(steps_file + ".tmp", "w") as f:
            f.write(str(step))
        os.replace(steps_file + ".tmp", steps_file)
        published = time.monotonic()
"""

# Holds the GIL inside one C call that waits in the kernel (ctypes.PyDLL keeps the GIL),
# as a checkpoint save or a long native call does, beside a worker thread waiting for work
# (as a framework's thread pool does); then trains as above.
HOLDS_THE_GIL = """
import ctypes, sys, threading, time
idle = threading.Lock()
idle.acquire()
threading.Thread(target=idle.acquire, daemon=True).start()
open(sys.argv[2], "w").write(str(time.monotonic() + int(sys.argv[1])))  # when it lets go
print("ready", flush=True)
ctypes.PyDLL(None).sleep(int(sys.argv[1]))
while True:
    time.sleep(0.01)
"""


def start(args: list[str], started: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    process = subprocess.Popen(args, text=True, start_new_session=True, cwd="/",
                               stdout=subprocess.PIPE)
    started.append(process)
    assert process.stdout is not None
    assert process.stdout.readline() == "ready\n"
    return process


def status(pid: int, field: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return line.split(":", 1)[1].split()[0]
    return ""


def steps(path: Path) -> int:
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text())
    return -1


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def training_goes_on(job: subprocess.Popen[str]) -> str | None:
    """None while the job computes on (its CPU time grows: sooner told than its steps,
    which take seconds), untraced; else what is wrong with it. A step is mostly a
    2 ms sleep: on an idle machine the job adds about 0.1 s of CPU in 5 s, and less
    on a loaded one, so a few clock ticks tell, and a hung job adds none."""
    before = cpu_seconds(job.pid)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if job.poll() is not None:
            return f"died with {job.returncode}"
        if cpu_seconds(job.pid) >= before + 3 / os.sysconf("SC_CLK_TCK"):
            break
        time.sleep(0.05)
    else:
        state = Path(f"/proc/{job.pid}/stat").read_text().rpartition(")")[2].split()[0]
        return f"made no progress in 10 s (state {state})"
    tracer = status(job.pid, "TracerPid")
    return None if tracer == "0" else f"still traced by {tracer}"


def leftovers(token: str, tmpdir: Path) -> list[str]:
    """Files an injection of code holding ``token`` left: bootstrap folders in /tmp, gdb
    scripts in the agent's temporary directory."""
    found = [str(path) for path in tmpdir.iterdir()]
    for folder in Path("/tmp").glob("dlprof-bootstrap-*"):
        with contextlib.suppress(OSError):
            if token in (folder / "bootstrap.py").read_text():
                found.append(str(folder))
    return found


def test_killing_the_agent_and_gdb_at_any_moment_leaves_the_job_training(
        processes: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    """20 injections, each killed (the agent and all it started, SIGKILL) at a random
    moment from its start to a little past its usual end, into a job that holds the GIL
    most of the time: the job survives every one, untraced and training, and nothing is
    left in /tmp."""
    steps_file = tmp_path / "steps"
    agent_tmp = tmp_path / "agent-tmp"
    agent_tmp.mkdir()
    token = secrets.token_hex(8)
    marker = tmp_path / "injected"
    code = f"open({str(marker)!r}, 'a').write({token!r})"
    attempt = ("import sys\n"
               "from dlprof_agent.collectors.target import Target\n"
               "from dlprof_agent.reach.inject import inject\n"
               "inject(Target.of(int(sys.argv[1])), sys.argv[2])\n"
               "print('injected', flush=True)\n")
    env = {**agent_env(), "TMPDIR": str(agent_tmp)}

    def new_job() -> subprocess.Popen[str]:
        steps_file.unlink(missing_ok=True)
        job = start([sys.executable, "-c", TRAINING, str(steps_file), "3"], processes)
        assert training_goes_on(job) is None
        return job

    def agent(job: subprocess.Popen[str]) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", attempt, str(job.pid), code], env=env,
                                cwd="/", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)

    def end(job: subprocess.Popen[str]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(10)

    job = new_job()
    began = time.monotonic()
    whole = agent(job)
    output = whole.communicate(timeout=60)[0]
    duration = time.monotonic() - began
    assert whole.returncode == 0, output
    assert training_goes_on(job) is None
    end(job)

    rng = random.Random(15)
    tries, harmed = 20, []
    for attempt_number in range(tries):
        job = new_job()  # each kill meets a job that has never been injected
        delay = rng.uniform(0.0, duration * 1.1)
        side = agent(job)
        time.sleep(delay)
        kill_agent_side(side)
        if side.stdout is not None:
            side.stdout.close()
        problem = training_goes_on(job)
        if problem is not None:
            harmed.append(f"try {attempt_number} (killed at {delay:.2f} s): the job {problem}")
        end(job)
    left = leftovers(token, agent_tmp)
    assert not harmed and not left, (
        f"{len(harmed)} of {tries} kills harmed the job, and {len(left)} files were left "
        f"(an injection takes {duration:.2f} s here):\n" + "\n".join(harmed + left[:3]))


def test_a_job_holding_the_gil_longer_than_the_wait_gets_the_code_once_it_lets_go(
        processes: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    """The job holds the GIL for 11 s inside a C call, past the agent's 10 s wait: the
    code is queued at once, the job runs it when its hold ends, and meanwhile no debugger
    and no breakpoint stay in it."""
    lets_go, out = tmp_path / "lets-go", tmp_path / "ran"
    job = start([sys.executable, "-c", HOLDS_THE_GIL, "11", str(lets_go)], processes)
    queued = inject(Target.of(job.pid),
                    f"import time; open({str(out)!r}, 'w').write(str(time.monotonic()))")
    assert queued is not None and queued.state() == "queued"
    assert pending.pending_bootstrap(Target.of(job.pid)) == queued
    assert inject(Target.of(job.pid), "open('/dev/null')") == queued  # not queued twice
    assert status(job.pid, "TracerPid") == "0"
    assert not out.exists()
    deadline = time.monotonic() + 20
    while not out.exists() and time.monotonic() < deadline:
        assert job.poll() is None, f"the job died with {job.returncode}"
        time.sleep(0.1)
    assert out.exists(), "the queued code never ran"
    assert float(out.read_text()) >= float(lets_go.read_text()) - 0.05  # not during the hold
    assert queued.state() == "ran"
    assert pending.pending_bootstrap(Target.of(job.pid)) is None
    assert job.poll() is None


@pytest.mark.parametrize("raises", ["raise SystemExit(3)", "1 / 0", "raise KeyboardInterrupt"])
def test_code_that_raises_leaves_the_job_running(
        processes: list[subprocess.Popen[str]], tmp_path: Path, raises: str) -> None:
    """PyRun_SimpleString would end the job on SystemExit and make the eval loop raise
    SystemError on any other exception; the queued code catches everything. A Ctrl-C that
    lands in it is handed back to the job."""
    steps_file, interrupted = tmp_path / "steps", tmp_path / "interrupted"
    on_sigint = ("import signal\nsignal.signal(signal.SIGINT, lambda *_: "
                 f"open({str(interrupted)!r}, 'w').write('yes'))\n")
    job = start([sys.executable, "-c", on_sigint + TRAINING, str(steps_file)], processes)
    inject(Target.of(job.pid), raises)
    time.sleep(0.5)
    assert training_goes_on(job) is None
    assert interrupted.exists() == (raises == "raise KeyboardInterrupt")


@pytest.mark.parametrize("injector", ["ptrace", "gdb"])
def test_a_job_that_exits_during_the_injection_is_reported_as_exited(
        injector: str, processes: list[subprocess.Popen[str]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The job ends after the agent found its runtime and saw it running, and before the
    injector attaches: that is what the message says, not a refusal of ptrace, nor that
    no such process was ever there. gdb never calls into a job that is gone, so its
    path runs wherever gdb does, AMX included."""
    if injector == "gdb":
        force_gdb(monkeypatch)
    elif not OWN_INJECTOR:
        pytest.skip(NO_OWN_INJECTOR)
    job = start([sys.executable, "-c", TRAINING, str(tmp_path / "steps")], processes)
    def exit_before_the_injector(target: Target) -> list[str]:
        assert target.pid == job.pid and target.is_running()
        os.kill(target.pid, signal.SIGKILL)
        # Not reaped: the pid is a zombie, as it is in a race.
        wait_until(lambda: status(target.pid, "State") == "Z", 10, what="the job's exit")
        return bootstrap_files.remove_stale_files(target)

    monkeypatch.setattr(inject_module, "remove_stale_files", exit_before_the_injector)
    with pytest.raises(TargetNotFound, match=f"process {job.pid} exited during the injection"):
        inject(Target.of(job.pid), "pass")


def test_a_job_that_never_waits_is_left_alone_then_injected_when_it_does(
        processes: list[subprocess.Popen[str]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pure-Python spin never enters the kernel, and has no safe point here (the eval
    loop's own code is not one, as where its extent is unknown): nothing is done to the
    job (the error says a later try may work), and a later try once it waits again
    succeeds."""
    without_eval_loop_stops(monkeypatch)
    out = tmp_path / "ran"
    spin = ("import time\nprint('ready', flush=True)\n"
            "end = time.monotonic() + 3\nwhile time.monotonic() < end: pass\n"
            "while True: time.sleep(0.01)\n")
    job = start([sys.executable, "-c", spin], processes)
    with pytest.raises(InjectionFailed, match="reached no safe point") as raised:
        inject(Target.of(job.pid), "pass", wait_seconds=1.0)
    assert type(raised.value).__name__ == "InjectionNotNow"
    assert status(job.pid, "TracerPid") == "0"
    time.sleep(2.5)
    inject(Target.of(job.pid), f"open({str(out)!r}, 'w').write('x')", wait_seconds=5.0)
    deadline = time.monotonic() + 5
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out.exists()
    assert job.poll() is None


def test_two_bootstraps_queued_before_either_ran_start_one_probe(
        processes: list[subprocess.Popen[str]], tmp_path: Path) -> None:
    """Two agents queue the probe's bootstrap while the job holds the GIL: both copies run
    once it lets go, one after the other, and only the first starts a probe."""
    holds = HOLDS_THE_GIL.replace(
        "while True:\n    time.sleep(0.01)\n",
        "end = time.monotonic() + 3\n"
        "while time.monotonic() < end:\n"
        "    time.sleep(0.01)\n"
        "print(sorted(t.name for t in threading.enumerate()), flush=True)\n"
        "time.sleep(60)\n")
    job = start([sys.executable, "-c", holds, "3", str(tmp_path / "lets-go")], processes)
    queued = inject(Target.of(job.pid), injection_code())
    assert queued is not None and queued.state() == "queued"
    other_agent = ("import sys\n"
                   "from dlprof_agent.collectors.target import Target\n"
                   "from dlprof_agent.reach.inject import inject\n"
                   "from dlprof_agent.probe.bootstrap import injection_code\n"
                   "print(inject(Target.of(int(sys.argv[1])), injection_code()).state())\n")
    second = subprocess.run([sys.executable, "-c", other_agent, str(job.pid)], env=agent_env(),
                            cwd="/", capture_output=True, text=True, timeout=60, check=False)
    assert second.stdout == "queued\n", second.stdout + second.stderr
    assert job.stdout is not None
    threads = job.stdout.readline()
    assert threads.count("'dlprof-probe'") == 1, threads
    assert queued.state() == "ran"


def test_stale_bootstrap_files_of_dead_agents_are_removed_and_nothing_else(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What an agent killed mid-injection left (a bootstrap folder naming its pid, or an
    older agent's unnamed folder or gdb script) goes once that agent is gone and the
    job had time to read it; a live agent's files, young files, another user's files,
    links and look-alikes stay. A folder that names its job stays while that job lives
    (its main thread may take the script hours later) and goes once it is gone, or its
    pid is another process's."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    old = time.time() - 3600

    def folder(name: str, *, age: float = old, script: bool = True) -> Path:
        path = tmp_path / name
        path.mkdir()
        if script:
            (path / "bootstrap.py").write_text("print('x')\n")
        os.utime(path, (age, age))
        return path

    gone = [folder(f"dlprof-bootstrap-{dead.pid}-{'a' * 16}"),
            folder(f"dlprof-bootstrap-{'b' * 16}"),  # an older agent's: no pid in the name
            folder(f"dlprof-bootstrap-{dead.pid}-{'c' * 16}", script=False),
            folder(f"dlprof-bootstrap-{dead.pid}-{dead.pid}.1-{'1' * 16}"),  # job gone
            # a live pid, but started at another time: the pid was reused
            folder(f"dlprof-bootstrap-{dead.pid}-{os.getpid()}.1-{'2' * 16}")]
    old_script = tmp_path / "tmpab_cd123.gdb"
    old_script.write_text("commands\n  echo dlprof-agent: probe bootstrap ran\\n\nend\n")
    os.utime(old_script, (old, old))
    gone.append(old_script)

    kept = [folder(f"dlprof-bootstrap-{os.getpid()}-{'d' * 16}"),  # its agent is alive
            folder(f"dlprof-bootstrap-{dead.pid}-{'e' * 16}", age=time.time()),  # young
            folder("dlprof-bootstrap-notours"),
            folder(f"dlprof-bootstrap-{dead.pid}-{os.getpid()}.{Target.of(os.getpid()).start_ticks}-"
                   f"{'3' * 16}")]  # its job lives, and may take it yet
    someone_elses = tmp_path / "tmpzz_zz999.gdb"
    someone_elses.write_text("break main\n")
    os.utime(someone_elses, (old, old))
    kept.append(someone_elses)
    target = folder("elsewhere")
    link = tmp_path / f"dlprof-bootstrap-{dead.pid}-{'f' * 16}"
    link.symlink_to(target)
    kept += [target, link]
    if os.geteuid() == 0:
        other = folder(f"dlprof-bootstrap-{dead.pid}-{'9' * 16}")
        os.chown(other, 65534, 65534)
        os.utime(other, (old, old))
        kept.append(other)

    removed = bootstrap_files.remove_stale_files()
    assert sorted(removed) == sorted(path.name for path in gone)
    assert [path for path in gone if os.path.lexists(path)] == []
    assert [path for path in kept if not os.path.lexists(path)] == []
    assert (target / "bootstrap.py").exists()


def test_where_the_agent_cannot_inject_itself_gdb_queues_the_code(
        processes: list[subprocess.Popen[str]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Off x86-64 (forced here), gdb makes the same two calls; the job goes on,
    untraced. gdb must put the thread it called into back whole: not on AMX before
    gdb 14.1."""
    refused = gdb_refusal()
    if refused is not None:
        pytest.skip(refused)
    force_gdb(monkeypatch)
    out = tmp_path / "ran"
    job = start([sys.executable, "-c", TRAINING, str(tmp_path / "steps")], processes)
    queued = inject(Target.of(job.pid), f"open({str(out)!r}, 'w').write('x')")
    assert queued is not None
    wait_until(out.exists, 5, what="the code gdb queued to run")
    assert queued.state() == "ran"
    assert training_goes_on(job) is None


def test_gdb_leaves_a_job_with_no_thread_waiting_in_the_kernel_alone(
        processes: list[subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    """gdb borrows only a thread that waits in the kernel: a job that never waits is not
    touched (so this runs wherever gdb does, AMX included)."""
    force_gdb(monkeypatch)
    spin = "print('ready', flush=True)\nwhile True: pass\n"
    spinner = start([sys.executable, "-c", spin], processes)
    with pytest.raises(InjectionFailed, match="reached no safe point"):
        inject(Target.of(spinner.pid), "pass", wait_seconds=0.5)
    assert status(spinner.pid, "TracerPid") == "0"
