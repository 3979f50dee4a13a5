"""How the agent reaches the probe in each kind of job: whether it came up, the
seconds from the first try, and the tries, as the agent makes them (an
injection, then the channel's retry pauses). Writes docs/reach.md.

    python -m benchmarks.reach [--out docs/reach.md] [--limit 30] [KIND ...]
    python -m benchmarks.reach --root build/roots/sid [KIND ...]

Each job runs on this machine's Python (the agent's), or with --root on the python3
of a Debian root (scripts/build-python-roots) through chroot, and is stopped after
its row. A --root run rewrites only that root's section of the file, and a run
without it keeps the roots' sections. Nothing here asserts: tests/test_reach_table.py
and tests/test_remote_debug.py do, on a few kinds."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dlprof_agent.collectors.target import Target
from dlprof_agent.probe.bootstrap import package_parent
from dlprof_agent.probe_link.channel import RETRY_SECONDS
from dlprof_agent.probe_link.connect import NoProbe, ProbeOptions, try_connect

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "docs" / "reach.md"
LIMIT_SECONDS = 30.0

# A worker thread that trains in Python while the main thread waits (the waits
# last longer than the limit; time.sleep's returns every 6 s).
_WORKER = """
import threading, time
def train():
    while True:
        sum(range(20000))
        time.sleep(0.001)
threading.Thread(target=train, daemon=True).start()
"""
_TORCH_LOOP = """
import torch
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data, target = torch.randn(64, 256), torch.randint(0, 10, (64,))
print("ready", flush=True)
while True:
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(data), target).backward()
    optimizer.step()
"""
_DATALOADER = """
import torch
from torch.utils.data import DataLoader, Dataset
class Slow(Dataset):
    def __len__(self):
        return 1 << 30
    def __getitem__(self, index):
        return torch.randn(256)
model = torch.nn.Linear(256, 10)
# Forked: 3.14's default start method, forkserver, cannot unpickle this script's Slow.
loader = DataLoader(Slow(), batch_size=64, num_workers=2, multiprocessing_context="fork")
print("ready", flush=True)
for batch in loader:
    model(batch).sum().backward()
"""
JOBS: dict[str, tuple[str, list[str]]] = {
    # kind: (script, command-line prefix)
    "pure-Python loop, one thread": (
        "print('ready', flush=True)\nwhile True:\n    pass\n", []),
    "pinned single-thread torch loop": (_TORCH_LOOP, ["taskset", "-c", "0"]),
    "torch DataLoader with forked workers": (_DATALOADER, []),
    "main in join()": (_WORKER + "import time\nworker = threading.Thread(target=time.sleep, "
                       "args=(3600,))\nworker.start()\nprint('ready', flush=True)\n"
                       "worker.join()\n", []),
    "main in lock.acquire()": (_WORKER + "lock = threading.Lock()\nlock.acquire()\n"
                               "print('ready', flush=True)\nlock.acquire()\n", []),
    "main in Event.wait(timeout)": (_WORKER + "print('ready', flush=True)\n"
                                    "threading.Event().wait(3600)\n", []),
    "main in queue.get()": (_WORKER + "import queue\nprint('ready', flush=True)\n"
                            "queue.Queue().get()\n", []),
    "main in time.sleep(6) in a loop": (_WORKER + "print('ready', flush=True)\n"
                                        "while True:\n    time.sleep(6)\n", []),
}


# The trainer tier's jobs (tests/jobs/), with the probe they would start themselves
# left out, so that it is injected: kind -> the script and its arguments.
DDP = "torchrun DDP job, 2 ranks (gloo), its rank 0"
TRAINERS: dict[str, list[str]] = {
    DDP: ["tests/jobs/torch_ddp.py"],
    "Hugging Face Trainer, tiny BERT from its config": ["tests/jobs/hf_trainer.py"],
    "Lightning Trainer": ["tests/jobs/lightning_fit.py"],
    "Keras fit (compiled)": ["tests/jobs/keras_fit.py"],
}
# How a trainer's processes are started (the default: one, on this Python); torchrun
# starts each rank as its own process on this Python, which is the one reached.
LAUNCHERS: dict[str, list[str]] = {
    DDP: [sys.executable, "-m", "torch.distributed.run", "--standalone",
          "--nproc-per-node", "2", "--no-python", sys.executable],
}
# The step log whose steps are awaited, and whose first line gives the pid reached
RANK_LOG_SUFFIX: dict[str, str] = {DDP: ".0"}
_WITHOUT_ITS_PROBE = """
import runpy, sys
import tests.jobs.step_log as step_log
step_log.enable_probe = lambda: None
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
TRAINER_START_SECONDS = 300.0  # imports and the first steps, on a loaded machine


@dataclass(frozen=True)
class Row:
    kind: str
    came_up: bool
    seconds: float  # from the first try to the probe's first answer, or to the give-up
    tries: int
    why: str = ""  # the last reason it was not reached (on a later try that reached it too)


def root_python_version(root: Path) -> str | None:
    """The version of the python3 in Debian root ``root`` ("3.14.1"); None when there
    is none that runs (not built, or the agent may not chroot)."""
    if not (root / "usr" / "bin" / "python3").exists():
        return None
    try:
        done = subprocess.run(["chroot", str(root), "python3", "-c",
                               "import platform; print(platform.python_version())"],
                              capture_output=True, text=True, timeout=60, check=False)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def show_package_in(root: Path) -> None:
    """Copy the agent's package into ``root`` where the injected bootstrap looks for it
    (the agent's own path), so a job inside the root can import the probe."""
    inside = root / package_parent().lstrip("/") / "dlprof_agent"
    shutil.rmtree(inside, ignore_errors=True)
    shutil.copytree(Path(package_parent()) / "dlprof_agent", inside,
                    ignore=shutil.ignore_patterns("__pycache__"))


# In a mount namespace of its own, a job in a root has /proc and a /dev/shm of its own
# (torch's DataLoader workers hand batches over in shared memory and read /proc); both
# go with the namespace when the job ends, and no other run in the root sees them.
_IN_ROOT = ('mount -t proc proc "$0/proc" && mount -t tmpfs -o mode=1777 tmpfs "$0/dev/shm"; '
            'exec chroot "$0" python3 -c "$1"')


def job_command(script: str, root: Path | None) -> list[str]:
    if root is None:
        return [sys.executable, "-c", script]
    if shutil.which("unshare") is None:
        return ["chroot", str(root.resolve()), "python3", "-c", script]
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", _IN_ROOT,
            str(root.resolve()), script]


def measure(kind: str, limit: float = LIMIT_SECONDS, root: Path | None = None) -> Row:
    """Start the job of ``kind`` and reach its probe as the agent does, for up to
    ``limit`` seconds; inside Debian root ``root`` when given (see show_package_in)."""
    script, prefix = JOBS[kind]
    if prefix and shutil.which(prefix[0]) is None:
        return Row(kind, False, 0.0, 0, f"{prefix[0]} is not installed")
    with tempfile.TemporaryDirectory(prefix="dlprof-reach-") as folder:
        job = subprocess.Popen([*prefix, *job_command(script, root)],
                               cwd=folder if root is None else root,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               start_new_session=True)
        try:
            assert job.stdout is not None
            # Lines before it are noise (torch's UCX without /proc in a root).
            if "ready\n" not in job.stdout:
                return Row(kind, False, 0.0, 0, "the job did not start")
            time.sleep(0.5)  # into its loop or wait
            return _reach(kind, job.pid, limit)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, 9)
            job.wait(30)


def measure_trainer(kind: str, limit: float = LIMIT_SECONDS) -> Row:
    """Start the trainer of ``kind``, wait for its third step, and reach its probe (of
    the rank that RANK_LOG_SUFFIX names, for a launcher's job)."""
    with tempfile.TemporaryDirectory(prefix="dlprof-reach-") as folder:
        step_log, until = Path(folder) / "steps.log", Path(folder) / "stop"
        awaited = Path(f"{step_log}{RANK_LOG_SUFFIX.get(kind, '')}")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                          os.environ.get("PYTHONPATH")]))}
        job = subprocess.Popen([*LAUNCHERS.get(kind, [sys.executable]), "-c",
                                _WITHOUT_ITS_PROBE, *TRAINERS[kind],
                                "--step-log", str(step_log), "--until", str(until)],
                               cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + TRAINER_START_SECONDS
            while _steps_logged(awaited) < 3:
                if job.poll() is not None or time.monotonic() > deadline:
                    return Row(kind, False, 0.0, 0, "the job did not train")
                time.sleep(0.2)
            pid = _logged_pid(awaited) if kind in RANK_LOG_SUFFIX else job.pid
            if pid is None:
                return Row(kind, False, 0.0, 0, "the job did not say its pid")
            return _reach(kind, pid, limit)
        finally:
            until.touch()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, 9)
            job.wait(30)


def _logged_pid(path: Path) -> int | None:
    """The pid in the first line of a step log (tests/jobs/step_log.py)."""
    try:
        first = json.loads(path.read_text().splitlines()[0])
    except (OSError, IndexError, ValueError):
        return None
    pid = first.get("pid") if isinstance(first, dict) else None
    return pid if isinstance(pid, int) else None


def _steps_logged(path: Path) -> int:
    try:
        return sum('"step"' in line for line in path.read_text().splitlines())
    except OSError:
        return 0


def _reach(kind: str, pid: int, limit: float) -> Row:
    began = time.monotonic()
    tries, why = 0, ""
    while time.monotonic() - began < limit:
        tries += 1
        try:
            client = try_connect(Target.of(pid), ProbeOptions(), 1.0, 0.0)
        except NoProbe as error:
            why = str(error)
        else:
            seconds = time.monotonic() - began
            client.stop()
            return Row(kind, True, seconds, tries, why)
        pause = RETRY_SECONDS[min(tries - 1, len(RETRY_SECONDS) - 1)]
        time.sleep(max(0.0, min(pause, limit - (time.monotonic() - began))))
    return Row(kind, False, time.monotonic() - began, tries, why)


def _rows(rows: list[Row]) -> list[str]:
    lines = ["| kind of job | probe came up | seconds | tries | why not |", "|---|---|---|---|---|"]
    for row in rows:
        why = re.sub(r"process \d+", "the process", row.why).replace("|", "/")
        lines.append(f"| {row.kind} | {'yes' if row.came_up else 'no'} | {row.seconds:.1f} | "
                     f"{row.tries} | {why if not row.came_up else ''} |")
    return lines


ROOT_SECTION = "## In a Debian root: "


def root_section(rows: list[Row], limit: float, root: Path, version: str) -> str:
    """The section of ``--root`` rows: the same jobs, on the root's python3."""
    return "\n".join([
        f"{ROOT_SECTION}{root.name}, Python {version}",
        "",
        f"Written by `python -m benchmarks.reach --root ROOT`: each job runs as `chroot ROOT "
        f"python3 -c ...` (Python {version}), the agent on Python "
        f"{platform.python_version()} outside it, for up to {limit:g} s.",
        "",
        *_rows(rows),
    ]) + "\n"


def with_root_section(text: str, section: str) -> str:
    """``text`` with ``section`` in place of the section of the same root, where it
    was, or added at the end. Rows of the old section whose kinds ``section`` lacks
    are kept (a run of a few kinds updates those), in the order of ``JOBS``."""
    root = section.splitlines()[0].split(",")[0] + ","  # its title, up to the version
    parts = re.split(r"(?m)^(?=## )", text)
    old = next((part for part in parts if part.startswith(root)), None)
    if old is None:
        before = "".join(parts).rstrip("\n")
        return before + "\n\n" + section if before else section
    rows = {**_table_rows(old), **_table_rows(section)}
    order = [*JOBS, *(kind for kind in rows if kind not in JOBS)]
    table_lines = [rows[kind] for kind in order if kind in rows]
    lines = section.rstrip("\n").splitlines()
    head = [line for line in lines if not line.startswith("| ") or line.startswith(
        "| kind of job |")]
    merged = "\n".join(head + table_lines) + "\n"
    last = len(parts) - 1
    return "".join((merged if index == last else merged + "\n") if part is old else part
                   for index, part in enumerate(parts))


def _table_rows(section: str) -> dict[str, str]:
    """The table's lines of a section, by the kind of job they are about."""
    return {line.split("|")[1].strip(): line for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| kind of job |")}


def table(rows: list[Row], limit: float) -> str:
    lines = [
        "# Reaching the probe, by kind of job",
        "",
        "Written by `python -m benchmarks.reach` (the same rows, fewer of them, are checked",
        "by `tests/test_reach_table.py`). Each job is started on the agent's own Python,",
        "and its probe is reached as `attach` reaches it: an injection, then the channel's",
        f"retry pauses ({', '.join(f'{s:g}' for s in RETRY_SECONDS[:3])} s, ...), for up to "
        f"{limit:g} s. Seconds run from the",
        "first try to the probe's first answer, or to the give-up.",
        "",
        f"Python {platform.python_version()} on {platform.machine()}, Linux "
        f"{platform.release()}, {os.cpu_count()} CPUs.",
        "",
        *_rows(rows),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reach", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kinds", nargs="*", metavar="KIND", help="default: every kind")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--limit", type=float, default=LIMIT_SECONDS, metavar="SECONDS")
    parser.add_argument("--root", type=Path, metavar="DIR",
                        help="run the jobs (not the trainers) on the python3 of this Debian "
                             "root (scripts/build-python-roots), through chroot")
    args = parser.parse_args(argv)
    if args.root is not None:
        return _main_in_root(args)
    rows = []
    for kind in args.kinds or [*JOBS, *TRAINERS]:
        row = (measure_trainer if kind in TRAINERS else measure)(kind, args.limit)
        print(f"{kind}: {'up' if row.came_up else 'not up'} after {row.seconds:.1f} s, "
              f"{row.tries} tries", file=sys.stderr, flush=True)
        rows.append(row)
    text = table(rows, args.limit) + NOTES
    if args.out.exists():  # the roots' sections stay: each is rewritten by its --root run
        others = []  # and, after them, those another benchmark writes (no_harm.py's)
        for part in re.split(r"(?m)^(?=## )", args.out.read_text()):
            if part.startswith(ROOT_SECTION):
                text = with_root_section(text, part.rstrip("\n") + "\n")
            elif part.startswith("## ") and not part.startswith("## Notes"):  # not its own
                others.append(part.rstrip("\n") + "\n")
        text = "\n".join([text, *others])
    args.out.write_text(text)
    return 0


def _main_in_root(args: argparse.Namespace) -> int:
    root: Path = args.root
    version = root_python_version(root)
    if version is None:
        print(f"error: no python3 runs in {root}: build it with scripts/build-python-roots "
              "(as root)", file=sys.stderr)
        return 1
    show_package_in(root)
    rows = []
    for kind in args.kinds or list(JOBS):
        row = measure(kind, args.limit, root)
        print(f"{kind}: {'up' if row.came_up else 'not up'} after {row.seconds:.1f} s, "
              f"{row.tries} tries", file=sys.stderr, flush=True)
        rows.append(row)
    section = root_section(rows, args.limit, root, version)
    text = args.out.read_text() if args.out.exists() else ""
    args.out.write_text(with_root_section(text, section))
    return 0


NOTES = """
## Notes

- Python 3.13 and 3.14 targets run in Debian roots (`scripts/build-python-roots`:
  trixie, sid) and have their own sections below, written by `--root`; the table
  above is on the agent's Python.
- On 3.14 the probe is handed over with PEP 768's protocol: `sys.remote_exec` when
  the agent runs 3.14 too, else the agent writes the script's path, the pending flag
  and the eval-breaker bit itself through the job's `_Py_DebugOffsets`
  (`reach/remote_debug.py`). The main thread runs it at its next eval-breaker check:
  a busy loop, pure Python included, at once; a sleep when it returns (the probe
  stays queued, its file kept, withdrawn if the agent exits first).
- A 3.14 main thread in a lock wait (`join()`, `lock.acquire()`, `Event.wait()`,
  `queue.get()`) would take that script only when the wait returns: an interrupted
  wait runs `Py_MakePendingCalls`, not the remote debugger's script. So where the
  agent sees the main thread parked there, the ptrace injector queues the probe as a
  pending call instead and ends the wait with EINTR, as on 3.13; the interpreter runs
  it and waits again. Debian's 3.14 (LTO) waits in a copy of `_PyParkingLot_Park`
  with no symbol: the one `PyEvent_WaitTimed` calls, checked on the stack by its
  caller's return address right above its frame.
- A 3.14 job started with `PYTHON_DISABLE_REMOTE_DEBUG` set or with
  `-X disable-remote-debug` is left untouched: the agent says so and what to do.
- In a root each job runs in a mount namespace of its own, with /proc and a
  /dev/shm of its own mounted there (the DataLoader's workers need both); they go
  when the job ends.
- The injector opens the job's libc and libpython through the job's root, and a
  chroot's directory is taken off the paths its memory map shows: opened by the
  host's path, gdb called the host's libc addresses in a 3.13 job in a chroot.
- The torchrun row is `tests/jobs/torch_ddp.py` under `torchrun --standalone`, two
  ranks on gloo; its rank 0 is reached. It and the trainers are the trainer tier's
  jobs (`tests/jobs/`) with the probe they would start themselves left out.
- A busy job with no thread waiting in the kernel is reached through its main
  thread, stopped with no signal handler in progress at a PC in another library
  (libtorch, oneDNN, MKL) or, on 3.9-3.12, in the eval loop's own code
  (`_PyEval_EvalFrameDefault`, not the functions it calls). A pure-Python loop
  summing integers in a function is met there on 31-57% of stops (3.10-3.12), 19% at
  module level. On 3.13 a contended pending-call mutex would release the GIL in the
  middle of a bytecode, so a busy main thread is borrowed there only with the job's
  other threads stopped and that mutex free, until it has queued its call
  (`reach/pending_mutex.py`).
- On 3.9-3.13 the main thread's lock waits (`join()`, `lock.acquire()`,
  `Event.wait()`, `queue.get()`) end with EINTR and CPython waits again after running
  the probe's pending call (on 3.13, Park's own wait in the parking lot only); a
  `time.sleep` is never cut short, so the probe comes when it returns.
"""

if __name__ == "__main__":
    sys.exit(main())
