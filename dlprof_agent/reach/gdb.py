"""Queues the bootstrap with gdb, where the agent's own ptrace injector does not
run (not x86-64, or an address it could not check). gdb stops the job, calls ``mmap``
then ``Py_AddPendingCall`` on a thread that waits in the kernel, and detaches. Its own
return breakpoint stays in the job for the milliseconds of each call: a kill of gdb
inside one of those two windows still kills the job (the ptrace injector has no such
window)."""

from __future__ import annotations

import mmap
import shutil
import signal
import subprocess
import time

from dlprof_agent.collectors.procfs import (
    PROC_ROOT,
    executable_path,
    inside_root,
    read_executable,
)
from dlprof_agent.errors import InjectionFailed, InjectionNotNow, TargetGone
from dlprof_agent.reach.mapped_files import function_address, libc_path, mapped_file_paths
from dlprof_agent.reach.pending import (
    ADDRESS_PLACEHOLDER,
    FLAG_BYTES,
    QueuedBootstrap,
    pending_bootstrap,
    pending_payload,
    remember,
)
from dlprof_agent.reach.procfs import memory_map, raise_if_gone, running, start_ticks
from dlprof_agent.reach.refusal import refused
from dlprof_agent.reach.runtime import PythonRuntime
from dlprof_agent.reach.threads import (
    POLL_SECONDS,
    exited_during_injection,
    in_kernel,
    no_safe_point,
    same_process,
    thread_syscalls,
)

GDB_SESSION_SECONDS = 30.0  # a session takes milliseconds; this only bounds a stuck gdb
GDB_MARK = "dlprof-agent:"

# Runs in gdb's own Python, never in the job. gdb has stopped every thread. It calls into
# the job twice, on a thread stopped inside a system call (the main one when it is):
# mmap for a page, then Py_AddPendingCall; it writes the page through the debugger (no
# allocation in the job), prints one verdict line and detaches.
_GDB_PYTHON = """\
import gdb

def _say(*words):
    gdb.write(" ".join([{mark!r}] + [str(word) for word in words]) + "\\n")
    gdb.flush()

def _in_kernel(pid, lwp):
    try:
        with open("/proc/%d/task/%d/syscall" % (pid, lwp)) as file:
            state = file.read().split()
    except OSError:
        return False
    return bool(state) and state[0] not in ("running", "-1")

def _other_file(checked):
    # An address the agent found and checked against the job's memory: where gdb sees
    # another, gdb read another file than the job runs, and calling it kills the job.
    for name, address in checked.items():
        seen = int(gdb.parse_and_eval("(long)&%s" % name))
        if seen != address:
            return name
    return None

def _queue(payload):
    inferior = gdb.selected_inferior()
    pid = inferior.pid
    threads = sorted(inferior.threads(), key=lambda thread: thread.ptid[1] != pid)
    waiting = [thread for thread in threads if _in_kernel(pid, thread.ptid[1])]
    if not waiting:
        _say("no-thread-in-kernel")
        return
    waiting[0].switch()  # the main thread when it waits, else another one
    for library in ("libc[.]", "ld-musl", "libpython3"):
        gdb.execute("sharedlibrary " + library, to_string=True)
    mismatch = _other_file({checked!r})
    if mismatch is not None:
        _say("other-file", mismatch)
        return
    size = -(-len(payload) // {page}) * {page}
    address = int(gdb.parse_and_eval(
        "((long (*)(long, long, long, long, long, long))mmap)(0, %d, {prot}, {flags}, -1, 0)"
        % size))
    if address <= 0:
        _say("mmap-failed", address)
        return
    payload = payload.replace({placeholder!r}, ("%#018x" % address).encode(), 1)
    inferior.write_memory(address, payload)
    result = int(gdb.parse_and_eval(
        "((int (*)(void *, void *))Py_AddPendingCall)((void *)PyRun_SimpleString, (void *)%d)"
        % (address + {flag_bytes})))
    _say("queued", "%#x" % address, result)

try:
    _queue(bytes.fromhex({payload_hex!r}))
except Exception as error:
    _say("error", (str(error).splitlines() or [type(error).__name__])[0])
gdb.execute("detach", to_string=True)
"""


def _threads_in_kernel(pid: int) -> int:
    """How many threads of ``pid`` wait in a system call now. Raises TargetNotFound."""
    threads = thread_syscalls(pid)
    if not threads or not running(pid):
        raise_if_gone(pid)
    return sum(in_kernel(fields) for _, fields in threads)


def _wait_for_a_thread_in_kernel(pid: int, deadline: float) -> bool:
    while not _threads_in_kernel(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


def checked_addresses(pid: int, runtime: PythonRuntime | None) -> dict[str, int]:
    """The functions gdb is to call, where the agent finds them in the job and their
    bytes match the job's own files (``mapped_files``); those it cannot check are left
    out."""
    maps = memory_map(pid)
    libc = libc_path(maps)
    files: dict[str, tuple[str, list[str]]] = {}
    if libc is not None:
        files["mmap"] = (libc, mapped_file_paths(pid, libc, maps))
    if runtime is not None:
        try:
            exe = read_executable(pid)
        except TargetGone:
            exe = None
        python = (runtime.library, [executable_path(pid)] if runtime.library == exe
                  else mapped_file_paths(pid, runtime.library, maps))
        files["Py_AddPendingCall"] = files["PyRun_SimpleString"] = python
    found = {name: function_address(pid, maps, path, paths, name)
             for name, (path, paths) in files.items()}
    return {name: address for name, address in found.items() if address is not None}


def _gdb_command(gdb: str, pid: int, payload: bytes, checked: dict[str, int] | None = None
                 ) -> list[str]:
    script = _GDB_PYTHON.format(
        mark=GDB_MARK, page=mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, flag_bytes=FLAG_BYTES,
        placeholder=ADDRESS_PLACEHOLDER.encode(), payload_hex=payload.hex(),
        checked=checked or {})
    return [gdb, "--batch", "--nx", "-iex", "set auto-load off",
            "-iex", "set auto-solib-add off", "-iex", "set debuginfod enabled off",
            # A signal during a call (our SIGINT on a stuck session) unwinds the call.
            "-iex", "set unwindonsignal on",
            # The job's own files, through its root: in a chroot or a container gdb
            # would otherwise read the agent's libc by the same name and call its
            # addresses in the job.
            "-iex", f"set sysroot {inside_root(pid, '')}", "-se", executable_path(pid),
            "-p", str(pid), "-ex", f"python exec(bytes.fromhex('{script.encode().hex()}'))"]



def inject_with_gdb(pid: int, code: str, wait_seconds: float,
                    runtime: PythonRuntime | None = None) -> QueuedBootstrap:
    gdb = shutil.which("gdb")
    if gdb is None:
        raise InjectionFailed(
            f"cannot inject into process {pid}: gdb is not installed",
            "install it (e.g. apt install gdb) to inject into a running Python before 3.14, "
            "or start the job with `dlprof-agent run -- python ...`", pid=pid)
    queued = pending_bootstrap(pid)
    if queued is not None:
        return queued
    start_time = start_ticks(pid)
    command = _gdb_command(gdb, pid, pending_payload(code), checked_addresses(pid, runtime))
    deadline = time.monotonic() + wait_seconds
    while True:
        if not _wait_for_a_thread_in_kernel(pid, deadline):
            raise no_safe_point(pid, wait_seconds)
        output = _run_gdb(pid, command)
        verdict = next((line.split()[1:] for line in output.splitlines()
                        if line.startswith(GDB_MARK + " ")), None)
        if verdict and verdict[0] == "no-thread-in-kernel" and time.monotonic() < deadline:
            continue  # it left the kernel between our look and gdb's stop: look again
        break
    if verdict and verdict[0] == "queued" and len(verdict) == 3:
        if verdict[2] != "0":
            raise InjectionNotNow(f"process {pid} has a full queue of pending calls",
                                  "the agent tries again on its next passes", pid=pid)
        return remember(QueuedBootstrap(pid, start_time or 0, int(verdict[1], 16),
                                        time.monotonic()))
    if not same_process(pid, start_time):
        raise exited_during_injection(pid)
    if "ptrace: Operation not permitted" in output:
        raise refused(pid, PROC_ROOT, "ptrace was denied")
    if verdict and verdict[0] == "no-thread-in-kernel":
        raise no_safe_point(pid, wait_seconds)
    if verdict and verdict[0] == "other-file":
        raise InjectionFailed(
            f"not injecting into process {pid}: gdb reads another file for "
            f"{verdict[-1]} than the job runs, and calling it would kill the job",
            "start the job with `dlprof-agent run -- python ...` instead", pid=pid)
    detail = (" ".join(verdict) if verdict else None) or next(
        (line.strip() for line in output.splitlines()
         if "rror" in line or "not defined" in line), "gdb gave up")
    raise InjectionFailed(f"injecting into process {pid} failed: {detail}",
                          "start the job with `dlprof-agent run -- python ...` instead",
                          pid=pid)


def _run_gdb(pid: int, command: list[str]) -> str:
    # gdb gets its own session so that a Ctrl-C meant for the agent does not stop it
    # halfway; a kill of the whole agent side is what the pending-call design makes safe.
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        return process.communicate(timeout=GDB_SESSION_SECONDS)[0]
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)  # unwinds a call in progress, then detaches
        try:
            return process.communicate(timeout=10)[0]
        except subprocess.TimeoutExpired:
            process.kill()
            return process.communicate()[0]

