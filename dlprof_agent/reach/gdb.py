"""Queues the bootstrap with gdb, where the agent's own ptrace injector does not
run (a CPU with no place of its own, ``cpu``, or an address it could not check). gdb
stops the job, calls ``mmap`` then ``Py_AddPendingCall`` on a thread that waits in the
kernel, and detaches. Its own return breakpoint stays in the job for the milliseconds
of each call: a kill of gdb inside one of those two windows still kills the job (the
ptrace injector has no such window).

The thread gdb borrows was stopped inside a system call, which the kernel restarts when
gdb lets it go, from the registers gdb puts back after each call: on x86-64 rax holds
the restart code (-512 to -516) and orig_rax the call's number, and where orig_rax is
not put back the code reaches the job as an error (an ``OSError: [Errno 514]`` out of
``time.sleep``). gdb before 14.1 keeps the XSAVE area in a fixed buffer of 2696 bytes
(AVX-512 and PKRU) while the kernel takes the area back only whole
(``xstateregs_set``): on a CPU with a larger one (AMX's is 11008 bytes) each write of a
vector register fails, and gdb's putting back stops before orig_rax. So such a gdb is
refused there (``xstate_refusal``); the script checks that gdb can write the area
before any call, records the thread's general registers, and after the calls puts back
any gdb did not, orig_rax last: the kernel then restarts the call itself on detach, as
after any stop (``set $pc`` would not clear orig_rax: only gdb's own PC writes do, so
restarting it by hand would restart it twice). On aarch64 the kernel rewinds an
interrupted call (x0 from orig_x0, pc back to the svc) before the stop, so no restart
code is ever in the registers gdb sees; the general registers are checked the same way
(a relative sleep rewound there runs again whole: the kernel resumes it through
restart_syscall only when the PC it rewound to is not changed in between)."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import signal
import subprocess
import time

from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import InjectionFailed, InjectionNotNow, InjectionUnsafe, TargetGone
from dlprof_agent.reach.call_plan import runtime_life
from dlprof_agent.reach.gdb_versions import XSAVE_SIZED_GDB, gdb_version, xstate_refusal
from dlprof_agent.reach.mapped_files import function_address, libc_path, mapped_file_paths
from dlprof_agent.reach.pending import (
    ADDRESS_PLACEHOLDER,
    FLAG_BYTES,
    QueuedBootstrap,
    pending_bootstrap,
    pending_payload,
    remember,
)
from dlprof_agent.reach.procfs import (
    Mapping,
    executable,
    executable_path,
    inside_root_path,
    memory_map,
    raise_if_gone,
    running,
    state,
)
from dlprof_agent.reach.refusal import refused
from dlprof_agent.reach.runtime import PythonRuntime
from dlprof_agent.reach.shutdown import exiting
from dlprof_agent.reach.threads import (
    POLL_SECONDS,
    exited_during_injection,
    in_kernel,
    no_safe_point,
    thread_syscalls,
)
from dlprof_agent.reach.xsave_layout import LayoutUnknown, XsaveLayout, host_layout

log = logging.getLogger("dlprof_agent")

GDB_SESSION_SECONDS = 30.0  # a session takes milliseconds; this only bounds a stuck gdb
_UNWIND_SECONDS = 10.0  # for a stuck gdb to unwind its call and detach after SIGINT
_STOP_DELIVERY_SECONDS = 0.5  # for a SIGSTOP a killed gdb left pending to stop the job
GDB_MARK = "dlprof-agent:"
_RUN_INSTEAD = "or start the job with `dlprof-agent run -- python ...`"
# The registers recorded before gdb's calls and compared after, per gdb's name of the
# architecture; orig_rax last, so that the kernel restarts the call only once the rest
# is back
_GENERAL_REGISTERS = {
    "i386:x86-64": ("rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "rsp", "r8", "r9",
                    "r10", "r11", "r12", "r13", "r14", "r15", "rip", "eflags", "orig_rax"),
    "aarch64": (*(f"x{n}" for n in range(31)), "sp", "pc", "cpsr"),
}

# Runs in gdb's own Python, never in the job. gdb has stopped every thread. It calls into
# the job twice, on a thread stopped inside a system call (the main one when it is):
# mmap for a page, then Py_AddPendingCall; it writes the page through the debugger (no
# allocation in the job), prints one verdict line (and an "unrestored" line where it had
# to put registers back itself) and detaches.
_GDB_PYTHON = """\
import gdb

def _say(*words):
    gdb.write(" ".join([{mark!r}] + [str(word) for word in words]) + "\\n")
    gdb.flush()

def _registers(names):
    gdb.newest_frame().select()  # the thread's own registers, not a caller's saved ones
    return dict((name, int(gdb.parse_and_eval("$" + name))) for name in names)

def _flush():
    # Read what the thread holds, not gdb's copy
    for command in ("maintenance flush register-cache", "flushregs"):
        try:
            gdb.execute(command, to_string=True)
            return
        except gdb.error:
            pass

def _xstate_unwritable():
    # One vector register written and written back: where gdb cannot write the CPU's
    # whole XSAVE area it fails here, before any call, not halfway through putting
    # the thread back after one.
    try:
        word = int(gdb.parse_and_eval("$xmm15.v2_int64[0]"))
        gdb.execute("set $xmm15.v2_int64[0] = %d" % (word ^ 1), to_string=True)
        _flush()
        written = int(gdb.parse_and_eval("$xmm15.v2_int64[0]")) == word ^ 1
        gdb.execute("set $xmm15.v2_int64[0] = %d" % word, to_string=True)
    except gdb.error as error:
        return (str(error).splitlines() or ["error"])[0]
    return None if written else "the write did not reach the thread"

def _put_back(saved):
    # What gdb did not put back after its calls goes back now, in order (orig_rax
    # last); the names put back, and those still wrong after.
    try:
        _flush()
        wrong = [name for name, value in _registers(saved).items() if value != saved[name]]
        for name in wrong:
            gdb.newest_frame().select()
            gdb.execute("set $%s = %d" % (name, saved[name]), to_string=True)
        _flush()
        return wrong, [name for name, value in _registers(wrong).items()
                       if value != saved[name]]
    except gdb.error:
        return list(saved), list(saved)

def _in_kernel(pid, lwp):
    try:
        with open("/proc/%d/task/%d/syscall" % (pid, lwp)) as file:
            state = file.read().split()
    except OSError:
        return False
    if not state or state[0] == "running":
        return False
    if state[0] != "-1":
        return True
    # arm64 forgets the number of a wait that gdb's stop interrupted, its pc rewound to
    # the svc to make the call again: a thread in the kernel all the same
    try:
        return (gdb.selected_frame().architecture().name() == "aarch64"
                and int.from_bytes(bytes(gdb.selected_inferior().read_memory(
                    int(state[-1], 16), 4)), "little") == 0xD4000001)  # svc #0
    except (gdb.error, ValueError):
        return False

def _shutting_down(words):
    # As the agent's reach/shutdown.py reads them, with every thread stopped
    if words is None:
        return False
    finalizing, initialized, interpreters = words
    memory = gdb.selected_inferior()

    def word(address, size):
        return int.from_bytes(bytes(memory.read_memory(address, size)), "little")

    return bool(word(finalizing, 8)
                or (initialized is not None and word(initialized, 4) != 1)
                or (interpreters is not None and not word(interpreters, 8)))

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
    if _shutting_down({life!r}):
        _say("shutting-down")  # a call now would find no interpreter
        return
    waiting[0].switch()  # the main thread when it waits, else another one
    for library in ("libc[.]", "ld-musl", "libpython3"):
        gdb.execute("sharedlibrary " + library, to_string=True)
    mismatch = _other_file({checked!r})
    if mismatch is not None:
        _say("other-file", mismatch)
        return
    architecture = gdb.selected_frame().architecture().name()
    if architecture == "i386:x86-64":
        why = _xstate_unwritable()
        if why is not None:
            _say("xstate-unwritable", why)
            return
    saved = _registers({general!r}.get(architecture, ()))
    try:
        _call(payload)
    finally:
        wrong, lost = _put_back(saved) if saved else ([], [])
        if wrong:
            _say("unrestored", ",".join(wrong), ",".join(lost) or "-")

def _call(payload):
    size = -(-len(payload) // {page}) * {page}
    address = int(gdb.parse_and_eval(
        "((long (*)(long, long, long, long, long, long))mmap)(0, %d, {prot}, {flags}, -1, 0)"
        % size))
    if address <= 0:
        _say("mmap-failed", address)
        return
    payload = payload.replace({placeholder!r}, ("%#018x" % address).encode(), 1)
    gdb.selected_inferior().write_memory(address, payload)
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


def _threads_in_kernel(target: Target) -> int:
    """How many threads of the target wait in a system call now. Raises TargetNotFound."""
    threads = thread_syscalls(target)
    if not threads or not running(target.pid, procfs=target.procfs):
        raise_if_gone(target.pid, procfs=target.procfs)
    return sum(in_kernel(fields) for _, fields in threads)


def _wait_for_a_thread_in_kernel(target: Target, deadline: float) -> bool:
    while not _threads_in_kernel(target):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


def checked_addresses(target: Target, runtime: PythonRuntime | None) -> dict[str, int]:
    """The functions gdb is to call, where the agent finds them in the job and their
    bytes match the job's own files (``mapped_files``); those it cannot check are left
    out."""
    maps = memory_map(target.pid, procfs=target.procfs)
    libc = libc_path(maps)
    files: dict[str, tuple[str, list[str]]] = {}
    if libc is not None:
        files["mmap"] = (libc, mapped_file_paths(target, libc, maps))
    if runtime is not None:
        python = (runtime.library, _python_files(target, runtime, maps))
        files["Py_AddPendingCall"] = files["PyRun_SimpleString"] = python
    found = {name: function_address(target, maps, path, paths, name)
             for name, (path, paths) in files.items()}
    return {name: address for name, address in found.items() if address is not None}


def _python_files(target: Target, runtime: PythonRuntime, maps: list[Mapping]) -> list[str]:
    try:
        exe = executable(target.pid, procfs=target.procfs)
    except TargetGone:
        exe = None
    return ([executable_path(target.pid, procfs=target.procfs)] if runtime.library == exe
            else mapped_file_paths(target, runtime.library, maps))


def _life(target: Target, runtime: PythonRuntime | None
          ) -> tuple[int, int | None, int | None] | None:
    if runtime is None:
        return None
    maps = memory_map(target.pid, procfs=target.procfs)
    words = runtime_life(target, maps, runtime, _python_files(target, runtime, maps))
    return None if words is None else (words.finalizing, words.initialized,
                                       words.interpreters)


def _gdb_command(gdb: str, target: Target, payload: bytes, checked: dict[str, int] | None = None,
                 life: tuple[int, int | None, int | None] | None = None) -> list[str]:
    script = _GDB_PYTHON.format(
        mark=GDB_MARK, page=mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, flag_bytes=FLAG_BYTES,
        placeholder=ADDRESS_PLACEHOLDER.encode(), payload_hex=payload.hex(),
        checked=checked or {}, general=_GENERAL_REGISTERS, life=life)
    return [gdb, "--batch", "--nx", "-iex", "set auto-load off",
            "-iex", "set auto-solib-add off", "-iex", "set debuginfod enabled off",
            # A signal during a call (our SIGINT on a stuck session) unwinds the call.
            "-iex", "set unwindonsignal on",
            # The job's own files, through its root: in a chroot or a container gdb
            # would otherwise read the agent's libc by the same name and call its
            # addresses in the job.
            "-iex", f"set sysroot {inside_root_path(target.pid, '', procfs=target.procfs)}",
            "-se", executable_path(target.pid, procfs=target.procfs), "-p", str(target.pid),
            "-ex", f"python exec(bytes.fromhex('{script.encode().hex()}'))"]



def _refuse_unsafe_gdb(target: Target, gdb: str) -> None:
    try:
        layout: XsaveLayout | None = host_layout()
    except LayoutUnknown:
        layout = None  # not x86-64, or no XSAVE: nothing gdb could cut short
    why = xstate_refusal(gdb_version(gdb), layout)
    if why is not None:
        raise _unsafe(target, why)


def _unsafe(target: Target, why: str) -> InjectionUnsafe:
    return InjectionUnsafe(
        f"not injecting into process {target.pid} with gdb: {why}",
        "install gdb {}.{} or newer, {}".format(*XSAVE_SIZED_GDB, _RUN_INSTEAD), pid=target.pid)


def inject_with_gdb(target: Target, code: str, wait_seconds: float,
                    runtime: PythonRuntime | None = None) -> QueuedBootstrap:
    pid = target.pid
    gdb = shutil.which("gdb")
    if gdb is None:
        raise InjectionFailed(
            f"cannot inject into process {pid}: gdb is not installed",
            "install it (e.g. apt install gdb) to inject into a running Python before 3.14, "
            "or start the job with `dlprof-agent run -- python ...`", pid=pid)
    if not target.is_running():
        # Gone since it was found (no mappings left to plan from): not gdb's refusal.
        raise exited_during_injection(target)
    _refuse_unsafe_gdb(target, gdb)
    queued = pending_bootstrap(target)
    if queued is not None:
        return queued
    command = _gdb_command(gdb, target, pending_payload(code),
                           checked_addresses(target, runtime), _life(target, runtime))
    deadline = time.monotonic() + wait_seconds
    while True:
        if not _wait_for_a_thread_in_kernel(target, deadline):
            raise no_safe_point(target, wait_seconds)
        output = _run_gdb(target, command)
        said = [line.split()[1:] for line in output.splitlines()
                if line.startswith(GDB_MARK + " ")]
        verdict = next((words for words in said if words and words[0] != "unrestored"),
                       None)
        if verdict and verdict[0] == "no-thread-in-kernel" and time.monotonic() < deadline:
            continue  # it left the kernel between our look and gdb's stop: look again
        break
    _check_restored(target, next((words for words in said if words[:1] == ["unrestored"]),
                              None))
    if verdict and verdict[0] == "queued" and len(verdict) == 3:
        if verdict[2] != "0":
            raise InjectionNotNow(f"process {pid} has a full queue of pending calls",
                                  "the agent tries again on its next passes", pid=pid)
        return remember(QueuedBootstrap(target, int(verdict[1], 16), time.monotonic()))
    if not target.is_running():
        raise exited_during_injection(target)
    if "ptrace: Operation not permitted" in output:
        raise refused(target, "ptrace was denied")
    if verdict and verdict[0] == "no-thread-in-kernel":
        raise no_safe_point(target, wait_seconds)
    if verdict and verdict[0] == "shutting-down":
        raise exiting(target)
    if verdict and verdict[0] == "xstate-unwritable":
        raise _unsafe(target, "it cannot write the extended registers (XSAVE) of this CPU: "
                      + " ".join(verdict[1:]).rstrip("."))
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


def _check_restored(target: Target, unrestored: list[str] | None) -> None:
    """gdb's script says which registers of the thread it called into gdb had not put
    back, and which of those it could not put back itself."""
    if unrestored is None or len(unrestored) < 3:
        return
    if unrestored[2] != "-":
        raise _unsafe(target, f"it left registers {unrestored[2]} of the thread it called "
                      "into changed; the job may fail")
    log.warning("pid %d: gdb did not put back registers %s of the thread it called into; "
                "the agent did", target.pid, unrestored[1])


def _stops_within(target: Target, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while state(target.pid, procfs=target.procfs) != "T":
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


def _run_gdb(target: Target, command: list[str]) -> str:
    # gdb gets its own session so that a Ctrl-C meant for the agent does not stop it
    # halfway; a kill of the whole agent side is what the pending-call design makes safe.
    stopped_before = state(target.pid, procfs=target.procfs) == "T"
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        return process.communicate(timeout=GDB_SESSION_SECONDS)[0]
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)  # unwinds a call in progress, then detaches
        try:
            return process.communicate(timeout=_UNWIND_SECONDS)[0]
        except subprocess.TimeoutExpired:
            process.kill()
            return process.communicate()[0]
    finally:
        # A gdb killed between its attach and its wait leaves the SIGSTOP of
        # PTRACE_ATTACH to stop the job once detached (ptrace(2)): that stop is ours.
        if not stopped_before and process.returncode == -signal.SIGKILL \
                and _stops_within(target, _STOP_DELIVERY_SECONDS):
            log.warning("pid %d: gdb was killed while attached and left the job stopped; "
                        "the agent continues it", target.pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(target.pid, signal.SIGCONT)

