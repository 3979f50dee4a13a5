"""Captures the /proc tree under tests/data/procfs/ that tests/test_procfs.py reads.

    .venv/bin/python tests/capture_procfs.py

Starts four small processes with a fixed environment and limits, copies only the
files the reader reads, and writes manifest.json: which pid is which, and what
psutil (a parser independent of ours) read from the live processes right after
the copy. The processes sleep meanwhile, so their counters stand still.

- plain: one thread, its name "py) (plain job" (a ") (" in the name);
- threaded: named threads "loader 0", "loader) 1" and "reducer";
- zombie: a child that exited and that its parent does not reap;
- unreadable: its environ is left out of the copy; the test puts one back with
  mode 000 in a temporary copy (git keeps no mode 000).

Scrubbed: the command lines name "python3", not this machine's interpreter, and
every cgroup path is replaced by a fixed one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

OUT = Path(__file__).resolve().parent / "data" / "procfs"
ENVIRONMENT = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOSTNAME": "node-0",
               "DLPROF_AGENT_RUNTIME_DIR": "/run/dlprof-capture", "JOB_NAME": "capture",
               "GREETING": "gr\u00fc\u00df dich"}
OPEN_FILES_LIMIT = (256, 512)  # soft, hard: set in each process so the test knows them
CGROUP_PATH = "/dlprof-capture"

_NAME = f"""
import ctypes, resource
resource.setrlimit(resource.RLIMIT_NOFILE, {OPEN_FILES_LIMIT})
def name(text):
    ctypes.CDLL(None).prctl(15, text.encode(), 0, 0, 0)  # PR_SET_NAME
"""
PROGRAMS = {
    "plain": _NAME + """
import time
name("py) (plain job")
print("ready", flush=True)
time.sleep(600)
""",
    "threaded": _NAME + """
import threading, time
name("trainer")
named = threading.Barrier(4)
def work(thread_name):
    name(thread_name)
    named.wait()
    time.sleep(600)
for thread_name in ("loader 0", "loader) 1", "reducer"):
    threading.Thread(target=work, args=(thread_name,), daemon=True).start()
named.wait()
print("ready", flush=True)
time.sleep(600)
""",
    "zombie": _NAME + """
import os, time
name("zombie parent")
child = os.fork()
if child == 0:
    name("zombie")
    os._exit(3)
while open(f"/proc/{child}/stat").read().rpartition(")")[2].split()[0] != "Z":
    time.sleep(0.01)
print(child, flush=True)
time.sleep(600)
""",
    "unreadable": _NAME + """
import time
name("secret env")
print("ready", flush=True)
time.sleep(600)
""",
}

# The files the reader reads, per process and per thread.
PROCESS_FILES = ("stat", "status", "io", "environ", "cgroup", "limits", "comm", "cmdline")
THREAD_FILES = ("stat", "status", "comm")


def _copy(source: Path, target: Path, names: tuple[str, ...]) -> list[str]:
    target.mkdir(parents=True)
    copied = []
    for name in names:
        try:
            data = (source / name).read_bytes()
        except OSError:
            continue
        if name == "cgroup":
            data = b"".join(line.rpartition(b":")[0] + b":" + CGROUP_PATH.encode() + b"\n"
                            for line in data.splitlines())
        (target / name).write_bytes(data)
        copied.append(name)
    return copied


def _capture(pid: int, role: str, program: str) -> dict[str, Any]:
    source, target = Path(f"/proc/{pid}"), OUT / str(pid)
    copied = _copy(source, target, PROCESS_FILES)
    if (target / "cmdline").read_bytes():  # a zombie's is empty
        (target / "cmdline").write_bytes(
            b"\0".join((b"python3", b"-c", program.encode())) + b"\0")
    if role == "unreadable":
        (target / "environ").unlink()
        copied.remove("environ")
    (target / "fd").mkdir()
    (target / "fd" / ".keep").touch()  # git keeps no empty folder (a zombie's)
    for fd in os.listdir(source / "fd"):
        (target / "fd" / fd).touch()  # only their number counts
    tids = sorted(int(tid) for tid in os.listdir(source / "task"))
    for tid in tids:
        _copy(source / "task" / str(tid), target / "task" / str(tid), THREAD_FILES)
    return {"pid": pid, "files": sorted(copied), "tids": tids, "psutil": _psutil_view(pid)}


def _psutil_view(pid: int) -> dict[str, Any]:
    process = psutil.Process(pid)
    with process.oneshot():
        cpu, memory = process.cpu_times(), process.memory_info()
        switches, io = process.num_ctx_switches(), process.io_counters()
        return {"ppid": process.ppid(), "name": process.name(), "status": process.status(),
                "threads": process.num_threads(), "user_seconds": cpu.user,
                "system_seconds": cpu.system, "rss_bytes": memory.rss,
                "vms_bytes": memory.vms, "voluntary": switches.voluntary,
                "involuntary": switches.involuntary, "uids": list(process.uids()),
                "open_fds": process.num_fds(), "io": io._asdict(),
                "thread_ids": sorted(thread.id for thread in process.threads())}


def main() -> int:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    started: list[subprocess.Popen[str]] = []
    manifest: dict[str, Any] = {"clock_ticks_per_second": os.sysconf("SC_CLK_TCK"),
                                "page_size_bytes": os.sysconf("SC_PAGE_SIZE"),
                                "environment": ENVIRONMENT, "open_files": OPEN_FILES_LIMIT,
                                "cgroup_path": CGROUP_PATH, "processes": {}}
    try:
        pids = {}
        for role, program in PROGRAMS.items():
            process = subprocess.Popen([sys.executable, "-c", program], env=ENVIRONMENT,
                                       stdout=subprocess.PIPE, text=True)
            started.append(process)
            assert process.stdout is not None
            line = process.stdout.readline().strip()
            pids[role] = int(line) if role == "zombie" else process.pid
            if role == "zombie":
                pids["zombie parent"] = process.pid
        for role, pid in pids.items():
            program = PROGRAMS["zombie" if role == "zombie parent" else role]
            manifest["processes"][role] = _capture(pid, role, program)
    finally:
        for process in started:
            process.send_signal(signal.SIGKILL)
            process.wait()
    (OUT / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    size = sum(path.stat().st_size for path in OUT.rglob("*") if path.is_file())
    print(f"captured {len(pids)} processes into {OUT.name}/: {size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
