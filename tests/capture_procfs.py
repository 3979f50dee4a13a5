"""Captures the /proc tree under tests/data/procfs/ that tests/test_procfs.py reads,
and with --identity the one under tests/data/procfs_identity/ that
tests/test_identity.py reads.

    .venv/bin/python tests/capture_procfs.py [--identity]

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

--identity starts one sleeping process per launcher's environment in IDENTITY
(a torchrun rank, a SLURM task, a TF_CONFIG worker, ...) and writes, in place of
this machine's cgroup file, the lines each runtime and cgroup driver writes
(test_identity.py cites where each shape comes from).
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


def _copy(source: Path, target: Path, names: tuple[str, ...], *,
          cgroup: bytes | None = None) -> list[str]:
    target.mkdir(parents=True)
    copied = []
    for name in names:
        try:
            data = (source / name).read_bytes()
        except OSError:
            continue
        if name == "cgroup" and cgroup is not None:
            data = cgroup
        elif name == "cgroup":
            data = b"".join(line.rpartition(b":")[0] + b":" + CGROUP_PATH.encode() + b"\n"
                            for line in data.splitlines())
        (target / name).write_bytes(data)
        copied.append(name)
    return copied


def _capture(pid: int, role: str, program: str, *, out: Path = OUT,
             cgroup: bytes | None = None) -> dict[str, Any]:
    source, target = Path(f"/proc/{pid}"), out / str(pid)
    copied = _copy(source, target, PROCESS_FILES, cgroup=cgroup)
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


OUT_IDENTITY = OUT.parent / "procfs_identity"
_CONTAINER = "3f1d2c4b" * 8  # a 64-digit container id
_POD = "5e1c7a2e-9b0c-4d5e-8f6a-7b8c9d0e1f2a"
_POD_SYSTEMD = _POD.replace("-", "_")  # systemd's slice names turn "-" into "_"
_V1_CONTROLLERS = ("memory", "cpu,cpuacct", "pids", "name=systemd")


def _v1(path: str) -> bytes:
    """A cgroup v1 file: the same path in every hierarchy, as a container's tasks have."""
    return "".join(f"{number}:{controllers}:{path}\n"
                   for number, controllers in enumerate(_V1_CONTROLLERS, 1)).encode()


def _v2(path: str) -> bytes:
    return f"0::{path}\n".encode()


_TF_CLUSTER = {"chief": ["tf-0:2222"], "worker": ["tf-1:2222", "tf-2:2222"],
               "ps": ["tf-3:2222"]}
# role -> (the launcher's environment, the cgroup file's lines)
IDENTITY: dict[str, tuple[dict[str, str], bytes]] = {
    # torchrun in a Kubeflow PyTorchJob pod: systemd driver, containerd, cgroup v2.
    "torchrun rank": ({"RANK": "5", "LOCAL_RANK": "1", "GROUP_RANK": "2", "WORLD_SIZE": "8",
                       "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "ddp-run-7",
                       "TORCHELASTIC_RESTART_COUNT": "1", "POD_NAME": "trainer-worker-1",
                       "POD_NAMESPACE": "ml"},
                      _v2("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
                          f"{_POD_SYSTEMD}.slice/cri-containerd-{_CONTAINER}.scope")),
    # srun's task on a bare-metal node: SLURM's own cgroup, no container.
    "slurm task": ({"SLURM_JOB_ID": "4711", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
                    "SLURM_NODEID": "1", "SLURM_NTASKS": "4", "SLURMD_NODENAME": "gpu-07"},
                   _v1("/slurm/uid_1000/job_4711/step_0/task_1")),
    # A MultiWorkerMirroredStrategy worker: cgroupfs driver, CRI-O, cgroup v1.
    "tf worker": ({"TF_CONFIG": json.dumps({"cluster": _TF_CLUSTER,
                                            "task": {"type": "worker", "index": 1}})},
                  _v1(f"/kubepods/besteffort/pod{_POD}/crio-{_CONTAINER}")),
    # Every source at once: DLPROF_JOB_ID and RANK win; docker's systemd scope.
    "explicit": ({"DLPROF_JOB_ID": "nightly-bert", "SLURM_JOB_ID": "4712", "RANK": "0",
                  "SLURM_PROCID": "9", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none"},
                 _v1(f"/system.slice/docker-{_CONTAINER}.scope")),
    # A Kubernetes Indexed Job: torchrun's default run id means no job id.
    "indexed job": ({"JOB_COMPLETION_INDEX": "3", "TORCHELASTIC_RUN_ID": "none"},
                    _v2(f"/kubepods/pod{_POD}/{_CONTAINER}")),
    # Malformed values: each leaves its label out.
    "malformed": ({"RANK": "abc", "SLURM_JOB_ID": "4713", "WORLD_SIZE": "-1",
                   "TF_CONFIG": "{\"cluster\": " + "x" * 5000},
                  _v2(f"/kubepods.slice/kubepods-pod{_POD_SYSTEMD}.slice/"
                      f"kata-{_CONTAINER}.scope")),
    # Its environ is left out of the copy (another user's, or hidepid).
    "unreadable": ({"RANK": "1", "SLURM_JOB_ID": "4714"}, _v2("/")),
}
_SLEEPER = 'print("ready", flush=True)\nimport time\ntime.sleep(600)\n'


def capture_identity() -> int:
    shutil.rmtree(OUT_IDENTITY, ignore_errors=True)
    OUT_IDENTITY.mkdir(parents=True)
    manifest: dict[str, Any] = {"processes": {}}
    started: list[subprocess.Popen[str]] = []
    try:
        for role, (environment, cgroup) in IDENTITY.items():
            process = subprocess.Popen([sys.executable, "-c", _SLEEPER],
                                       env={**ENVIRONMENT, **environment},
                                       stdout=subprocess.PIPE, text=True)
            started.append(process)
            assert process.stdout is not None
            process.stdout.readline()
            entry = _capture(process.pid, role, _SLEEPER, out=OUT_IDENTITY, cgroup=cgroup)
            manifest["processes"][role] = {"pid": entry["pid"], "environment": environment}
    finally:
        for process in started:
            process.send_signal(signal.SIGKILL)
            process.wait()
    (OUT_IDENTITY / "manifest.json").write_text(
        json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"captured {len(IDENTITY)} processes into {OUT_IDENTITY.name}/")
    return 0


if __name__ == "__main__":
    sys.exit(capture_identity() if sys.argv[1:] == ["--identity"] else main())
