"""Runs a short bootstrap string inside an already-running CPython process.

This is the only module that drives an injector: ``sys.remote_exec`` on Python 3.14+,
and before that its own ptrace injector on x86-64, or gdb elsewhere.

Two rules decide whether the job survives.

Where the code runs. A ptrace injector that stops a thread at an arbitrary instruction
and calls ``dlopen`` there deadlocks the job whenever that thread was inside ``malloc``
(measured: the ``hypno`` package hung a PyTorch job on about one attach in ten). So the
code is handed to the interpreter as a *pending call* (``Py_AddPendingCall``): the main
thread runs it between two bytecodes, with the GIL held, at a point the interpreter
chooses. Py_AddPendingCall needs neither the GIL nor a thread state ("doesn't require
the caller to hold the GIL", Python/ceval.c in 3.10 and 3.11; 3.12 and 3.13 ignore the
caller's thread state and target the main interpreter). It takes one lock around a
fixed ring of 32 entries and allocates nothing: a PyThread lock in 3.10-3.12
(``PyThread_acquire_lock(pending->lock, WAIT_LOCK)``), a PyMutex in 3.13
(Python/ceval_gil.c). It returns -1 only when the ring is full.

Nothing of ours may outlive the agent in the job. The old design left gdb waiting at a
breakpoint for a safe point, up to 10 s: a kill of the agent's side then (a systemd stop,
a cgroup kill, a container stop: gdb dies too) left an int3 that killed the job, or left
it stopped. Now:

- On x86-64 the agent is the tracer, and stops one thread only, one that waits in the
  kernel in a system call that leaves the signal mask alone (``/proc/<pid>/task/*/
  syscall``). A thread there is between two pieces of C code and cannot be inside the
  pending-call lock's critical section (that has no system call in it). With
  PTRACE_SEIZE and PTRACE_INTERRUPT no signal is sent, so a tracer that dies leaves the
  thread running as before. The agent writes, below the thread's red zone, a signal
  frame holding the thread's registers and FXSAVE state (its interrupted call set to be
  restarted, as the kernel does after a ptrace stop), and sets all registers at once so
  that the thread calls the function and returns into an ``rt_sigreturn`` of libc: the
  kernel puts the thread back exactly where it was. From then on the thread needs
  nothing from the agent: the agent may die at any instant and no trap, no breakpoint,
  no stopped thread is ever left. It is done twice: ``mmap`` (a page for the code, at a
  free address with MAP_FIXED_NOREPLACE, Linux 4.17+), then the agent writes the code
  there through /proc/<pid>/mem, then ``Py_AddPendingCall(PyRun_SimpleString, page)``.
  A thread stopped in a call the kernel would resume through ``restart_syscall``
  (relative sleeps, waits with a timeout) is not borrowed: rt_sigreturn would turn that
  resumption into EINTR. What may differ for the borrowed thread: the upper halves of
  its AVX registers are reset (dead across the libc call it waits in), and a wait for
  the 3.13 pending-call mutex itself (another thread adding a pending call at that very
  moment) could be lengthened.
- Elsewhere gdb does the same two calls with ``call`` on such a thread, for
  milliseconds: its own return breakpoint stays in the job for the duration of each
  call, and a kill of gdb inside one of those two windows still kills the job.

The pending call runs when the main thread next runs bytecode: at once for a training
loop; after a long C call holding the GIL, when that call returns (``inject`` returns
a QueuedBootstrap saying whether it has run, and does not queue a second copy meanwhile).
From another thread than the main one, 3.10-3.12 set the main thread's eval breaker the
next time it takes the GIL (take_gil recomputes it, bpo-40010); 3.13 sets it directly.
PyRun_SimpleString returns -1 when the code raises, which the eval loop turns into a
SystemError in the job (a SystemExit would end it), so the queued source catches
everything and hands a KeyboardInterrupt back to the main thread.

Before any of this, ``inject`` reads the ELF dynamic symbol tables of the target's
executable and of any mapped ``libpython3*.so*``, and touches the process only when one
of them defines the functions called; the agent checks each address it would call holds
the bytes of that function in the file. ``sys.remote_exec`` takes a file the *target*
opens, so that code goes to a file in the target's own ``/tmp`` (reached through
``/proc/<pid>/root``, which also works across mount namespaces).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import itertools
import mmap
import os
import platform
import pwd
import re
import secrets
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from dlprof_agent.collectors.process import read_state
from dlprof_agent.errors import (
    InjectionFailed,
    InjectionNotNow,
    InjectionRefused,
    NotPython,
    TargetNotFound,
)

# What gdb calls in the job (besides libc's mmap); both must be defined in the target
# (readelf --dyn-syms).
REQUIRED_SYMBOLS = frozenset({"Py_AddPendingCall", "PyRun_SimpleString"})
MIN_TARGET_VERSION = (3, 10)  # the probe's own floor
BOOTSTRAP_FILE_SECONDS = 120.0  # how long a remote_exec script stays on disk
CAP_SYS_PTRACE = 19  # bit in /proc/<pid>/status CapEff

_LIBPYTHON = re.compile(r"libpython3(?:\.(\d+))?[a-z]*\.so(?:\.|$)")
_PYTHON_EXE = re.compile(r"python(\d)\.(\d+)[a-z]*")
_MAX_TABLE_BYTES = 64 << 20  # a real .dynsym/.dynstr is far smaller; refuse garbage sizes


@dataclass(frozen=True)
class PythonRuntime:
    library: str  # path, as the target sees it, of the ELF file exporting the C API
    version: tuple[int, int] | None  # (3, 11) when known, else None


# --- ELF .dynsym reader ---------------------------------------------------------------

_SHT_NOBITS = 8
_ET_DYN = 3
_CALLED = frozenset({"Py_AddPendingCall", "PyRun_SimpleString", "mmap"})
_SHT_DYNSYM = 11
_SHN_UNDEF = 0
_SHN_LORESERVE = 0xFF00


@dataclass(frozen=True)
class _Layout:
    header: str  # e_type .. e_shstrndx, after the 16-byte e_ident
    section: str
    symbol: str
    symbol_fields: tuple[int, int, int, int]  # indexes of st_name, st_shndx, st_value, st_size


_LAYOUTS = {
    1: _Layout("HHIIIIIHHHHHH", "IIIIIIIIII", "IIIBBH", (0, 5, 1, 2)),  # ELF32
    2: _Layout("HHIQQQIHHHHHH", "IIQQQQIIQQ", "IBBHQQ", (0, 3, 4, 5)),  # ELF64
}


@dataclass(frozen=True)
class _Section:
    type: int
    addr: int
    offset: int
    size: int
    link: int
    entsize: int


@dataclass(frozen=True)
class _ElfScan:
    defined: frozenset[str]
    py_version: tuple[int, int] | None  # from the Py_Version constant (3.11+)
    shared: bool = True  # ET_DYN (a library or a PIE): addresses are relative to its base
    # name -> (st_value, offset in the file) of defined symbols in sections with contents
    locations: tuple[tuple[str, int, int], ...] = ()

    def location(self, name: str) -> tuple[int, int] | None:
        return next(((value, offset) for symbol, value, offset in self.locations
                     if symbol == name), None)


def _read_at(file: BinaryIO, offset: int, size: int, file_size: int) -> bytes | None:
    if offset < 0 or size < 0 or size > _MAX_TABLE_BYTES or offset + size > file_size:
        return None
    file.seek(offset)
    data = file.read(size)
    return data if len(data) == size else None


def _scan_elf(file: BinaryIO) -> _ElfScan | None:
    """Defined dynamic symbols of an open ELF file; None when it is not one we can read.

    Reads the header, the section headers, .dynsym and its string table, nothing else.
    Unreadable contents are None, but OSError from the file itself propagates.
    """
    file_size = os.fstat(file.fileno()).st_size
    ident = _read_at(file, 0, 16, file_size)
    if ident is None or ident[:4] != b"\x7fELF":
        return None
    if ident[4] not in _LAYOUTS or ident[5] not in (1, 2):  # class 32/64, little/big endian
        return None
    layout = _LAYOUTS[ident[4]]
    order = "<" if ident[5] == 1 else ">"
    header_format = order + layout.header
    header = _read_at(file, 16, struct.calcsize(header_format), file_size)
    if header is None:
        return None
    e_type, *_, shoff, _flags, _ehsize, _phentsize, _phnum, shentsize, shnum, _shstrndx = (
        struct.unpack(header_format, header))
    section_format = order + layout.section
    if shoff == 0 or shentsize < struct.calcsize(section_format):
        return None  # no section headers (stripped with sstrip, or not a file we understand)

    section_size = struct.calcsize(section_format)
    if shnum == 0:  # 0xff00 sections or more: the count is in section 0's sh_size
        first = _read_at(file, shoff, section_size, file_size)
        shnum = struct.unpack(section_format, first)[5] if first is not None else 0
    table = _read_at(file, shoff, shnum * shentsize, file_size)
    if table is None:
        return None
    sections = []
    for index in range(shnum):
        _name, type_, _flags, addr, offset, size, link, _info, _align, entsize = (
            struct.unpack_from(section_format, table, index * shentsize))
        sections.append(_Section(type_, addr, offset, size, link, entsize))
    dynsym = next((s for s in sections if s.type == _SHT_DYNSYM), None)
    if dynsym is None or not 0 < dynsym.link < len(sections):
        return None
    strtab = sections[dynsym.link]
    symbol_format = order + layout.symbol
    symbol_size = struct.calcsize(symbol_format)
    if dynsym.entsize not in (0, symbol_size):
        return None
    symbols = _read_at(file, dynsym.offset, dynsym.size - dynsym.size % symbol_size, file_size)
    names = _read_at(file, strtab.offset, strtab.size, file_size)
    if symbols is None or names is None:
        return None

    name_at, shndx_at, value_at, size_at = layout.symbol_fields
    defined: dict[str, tuple[int, int, int]] = {}
    for entry in struct.iter_unpack(symbol_format, symbols):
        shndx = entry[shndx_at]
        start = entry[name_at]
        if shndx == _SHN_UNDEF or start >= len(names):
            continue
        end = names.find(b"\0", start)
        name = names[start:end if end >= 0 else len(names)].decode("utf-8", "replace")
        if name:
            defined[name] = (shndx, entry[value_at], entry[size_at])

    locations = tuple(
        (name, value, sections[shndx].offset + value - sections[shndx].addr)
        for name, (shndx, value, _size) in defined.items()
        if name in _CALLED and shndx < min(len(sections), _SHN_LORESERVE)
        and sections[shndx].type != _SHT_NOBITS)
    return _ElfScan(frozenset(defined),
                    _py_version(file, file_size, sections, defined.get("Py_Version"), order),
                    shared=e_type == _ET_DYN, locations=locations)


def _py_version(file: BinaryIO, file_size: int, sections: list[_Section],
                symbol: tuple[int, int, int] | None, order: str) -> tuple[int, int] | None:
    """(major, minor) from the PY_VERSION_HEX constant ``Py_Version`` (Python 3.11+)."""
    if symbol is None:
        return None
    shndx, value, size = symbol
    if shndx >= min(len(sections), _SHN_LORESERVE) or size not in (4, 8):
        return None
    section = sections[shndx]
    if section.type == _SHT_NOBITS or not 0 <= value - section.addr < section.size:
        return None
    raw = _read_at(file, section.offset + value - section.addr, size, file_size)
    if raw is None:
        return None
    hexversion = int.from_bytes(raw, "little" if order == "<" else "big")
    major, minor = hexversion >> 24 & 0xFF, hexversion >> 16 & 0xFF
    return (major, minor) if major == 3 else None


def elf_defined_symbols(path: str) -> frozenset[str] | None:
    """Names of the symbols ELF file ``path`` defines in .dynsym; None when it is not a
    readable ELF file (missing, unreadable, truncated, not ELF). Never raises OSError."""
    try:
        with open(path, "rb") as file:
            scan = _scan_elf(file)
    except (OSError, struct.error):
        return None
    return None if scan is None else scan.defined


# --- finding the runtime --------------------------------------------------------------

def _version_from_name(path: str) -> tuple[int, int] | None:
    name = os.path.basename(path)
    library = _LIBPYTHON.match(name)
    if library is not None:
        return (3, int(library.group(1))) if library.group(1) else None
    exe = _PYTHON_EXE.fullmatch(name)
    return (int(exe.group(1)), int(exe.group(2))) if exe else None


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return file.read()
    except OSError:
        return None


def _raise_if_gone(pid: int, procfs: str) -> None:
    """The process behind a failed /proc read: TargetNotFound when there is none left."""
    state = read_state(pid, procfs=procfs)
    if state is None:
        raise TargetNotFound(f"no process with pid {pid}",
                             "check the pid with `ps -eo pid,user,args | grep python`")
    if state in ("Z", "X"):
        raise TargetNotFound(f"process {pid} has exited", "attach to a running job")


def _open_scan(path: str) -> _ElfScan | None:
    """Scan ``path``; None if it does not exist or is not ELF. PermissionError propagates."""
    try:
        with open(path, "rb") as file:
            return _scan_elf(file)
    except PermissionError:
        raise
    except (OSError, struct.error):
        return None


def _libpython_mappings(maps: str) -> dict[str, str]:
    """Mapped libpython3*.so* files: path as the target sees it -> one address range."""
    found: dict[str, str] = {}
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and _LIBPYTHON.match(os.path.basename(fields[5].split(" (")[0])):
            found.setdefault(fields[5], fields[0])
    return found


def _scan_mapped(pid: int, procfs: str, path: str, addresses: str) -> _ElfScan | None:
    # Through the target's root first (its mount namespace); then map_files, which
    # still opens a library deleted or replaced since it was loaded.
    start, _, end = addresses.partition("-")
    candidates = [f"{procfs}/{pid}/root{path.removesuffix(' (deleted)')}",
                  f"{procfs}/{pid}/map_files/{int(start, 16):x}-{int(end, 16):x}"]
    denied: PermissionError | None = None
    for candidate in candidates:
        try:
            scan = _open_scan(candidate)
        except PermissionError as error:
            denied = error
            continue
        if scan is not None:
            return scan
    if denied is not None:
        raise denied
    return None


def find_python_runtime(pid: int, *, procfs: str = "/proc") -> PythonRuntime | None:
    """The ELF file through which process ``pid`` exports the CPython C API.

    None when the process is not a CPython we can inject into: neither its executable
    nor a mapped ``libpython3*.so*`` defines all of REQUIRED_SYMBOLS (PyGILState_Ensure,
    PyRun_SimpleString, ...): a kernel thread, a shell, a Python that does not export them.
    ``library`` is the path as the target sees it (it may be in another mount namespace).
    Raises TargetNotFound when there is no such (live) process, and InjectionRefused
    when the process exists but the agent may not read its executable or mappings.
    """
    base = f"{procfs}/{pid}"
    try:
        exe_path = os.readlink(f"{base}/exe")
        # Opening the link itself reaches the file even across mount namespaces.
        exe_scan = _open_scan(f"{base}/exe")
    except PermissionError:
        raise _refused(pid, procfs, "cannot read its executable") from None
    except OSError:  # a kernel thread has no executable, an exited process no /proc entry
        _raise_if_gone(pid, procfs)
        return None
    exe_version = _version_from_name(exe_path.removesuffix(" (deleted)"))
    if exe_scan is not None and exe_scan.defined >= REQUIRED_SYMBOLS:
        return PythonRuntime(exe_path, exe_scan.py_version or exe_version)

    try:
        with open(f"{base}/maps", encoding="utf-8", errors="replace") as file:
            maps = file.read()
    except PermissionError:
        raise _refused(pid, procfs, "cannot read its memory map") from None
    except OSError:
        _raise_if_gone(pid, procfs)
        return None
    for path, addresses in _libpython_mappings(maps).items():
        try:
            scan = _scan_mapped(pid, procfs, path, addresses)
        except PermissionError:
            raise _refused(pid, procfs, f"cannot read {path}") from None
        if scan is not None and scan.defined >= REQUIRED_SYMBOLS:
            clean = path.removesuffix(" (deleted)")
            return PythonRuntime(clean, scan.py_version or _version_from_name(clean) or exe_version)
    return None


# --- errors ---------------------------------------------------------------------------

def _user(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"uid {uid}"


def _status_field(pid: int | str, field: str, procfs: str) -> str | None:
    for line in (_read_text(f"{procfs}/{pid}/status") or "").splitlines():
        key, _, value = line.partition(":")
        if key == field:
            return value.strip()
    return None


def _capabilities(pid: int | str, field: str, procfs: str) -> int | None:
    value = _status_field(pid, field, procfs)
    try:
        return int(value, 16) if value is not None else None
    except ValueError:
        return None


def _refused(pid: int, procfs: str, what: str) -> InjectionRefused:
    """The one-line refusal, with what would make the kernel say yes here."""
    tracer = _status_field(pid, "TracerPid", procfs)
    if tracer not in (None, "0"):
        comm = (_read_text(f"{procfs}/{tracer}/comm") or "?").strip()
        return InjectionRefused(
            f"cannot attach to process {pid}: it is already traced by pid {tracer} ({comm})",
            "only one tracer at a time: detach that debugger or profiler, then retry")
    try:
        owner = _user(os.stat(f"{procfs}/{pid}").st_uid)
    except OSError:
        owner = "another user"
    own_caps = _capabilities("self", "CapEff", procfs) or 0
    has_ptrace = bool(own_caps >> CAP_SYS_PTRACE & 1)
    message = (f"not allowed to attach to process {pid} ({what}; it is owned by {owner}, the "
               f"agent runs as {_user(os.getuid())} {'with' if has_ptrace else 'without'} "
               "CAP_SYS_PTRACE)")
    if not has_ptrace:
        hint = ("run the agent as the job's user or give it CAP_SYS_PTRACE (root without it is "
                "not enough; in a container: --cap-add SYS_PTRACE)")
    elif (_capabilities(pid, "CapPrm", procfs) or 0) & ~own_caps:
        # The kernel also wants the tracer to hold every capability the tracee holds.
        hint = ("the job holds capabilities the agent lacks: run the agent with at least the "
                "job's privileges (in a container: the same --cap-add/--privileged)")
    else:
        hint = ("the job may run in a parent user namespace, or a security module (AppArmor, "
                "SELinux) forbids ptrace: run the agent inside the job's container")
    scope = (_read_text(f"{procfs}/sys/kernel/yama/ptrace_scope") or "").strip()
    if scope == "1":
        hint += ("; kernel.yama.ptrace_scope is 1: only a parent process may attach unless "
                 "the agent has CAP_SYS_PTRACE, so the same user is not enough")
    elif scope == "2":
        hint += "; kernel.yama.ptrace_scope is 2: only a process with CAP_SYS_PTRACE may attach"
    elif scope == "3":
        hint = ("kernel.yama.ptrace_scope is 3: attaching is disabled until reboot, so the "
                "probe cannot be injected on this host; start the job with `dlprof-agent run`")
    elif scope:
        hint += f"; kernel.yama.ptrace_scope is {scope}"
    return InjectionRefused(message, hint)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0].rstrip(".") if text else type(error).__name__


# --- injecting ------------------------------------------------------------------------

def inject(pid: int, code: str, *, wait_seconds: float | None = None
           ) -> QueuedBootstrap | None:
    """Have process ``pid`` run ``code`` once, on its main thread, with the GIL held.

    The job runs it at its own next safe point, which may come after this returns: the
    result (gdb) tells whether it has run yet, and while it has not, injecting again
    returns it instead of queueing a second copy. Keep the code short and idempotent:
    import the probe and let it start its own thread.
    Raises NotPython (nothing was done to the process), InjectionRefused (the kernel
    would not let the agent attach), InjectionNotNow (nothing was done; a later try may
    work) or InjectionFailed. A pid with no live process, or one that exits meanwhile,
    raises ``dlprof_agent.agent.errors.TargetNotFound``, like every other place the agent
    meets a missing target, so the command line exits with the same code (3).
    Errors in ``code`` itself happen in the target and print to its stderr.
    """
    if pid == os.getpid():
        raise InjectionFailed("cannot inject into the agent's own process",
                              "give the training job's pid")
    runtime = find_python_runtime(pid)
    if runtime is None:
        comm = (_read_text(f"/proc/{pid}/comm") or "?").strip()
        raise NotPython(f"process {pid} ({comm}) is not a Python process the probe can run in",
                        "give the pid of the python process running the training script; "
                        f"for a launcher or shell, list its children with `pgrep -a -P {pid}`")
    if runtime.version is not None and runtime.version < MIN_TARGET_VERSION:
        major, minor = runtime.version
        raise NotPython(f"process {pid} runs python {major}.{minor}, too old for the probe",
                        "the probe needs python {}.{} or newer".format(*MIN_TARGET_VERSION))
    remove_stale_files(pid)
    try:
        return _inject(pid, code, runtime,
                       GDB_WAIT_SECONDS if wait_seconds is None else wait_seconds)
    except TargetNotFound:
        # It was there a moment ago: say so, rather than that no such process exists.
        raise TargetNotFound(f"process {pid} exited during the injection",
                             "attach to a running job") from None


def _inject(pid: int, code: str, runtime: PythonRuntime, wait_seconds: float
            ) -> QueuedBootstrap | None:
    remote_exec = getattr(sys, "remote_exec", None)
    if remote_exec is not None and runtime.version == sys.version_info[:2]:
        _inject_remote_exec(pid, code, remote_exec)
        return None
    queued = pending_bootstrap(pid)
    if queued is not None:
        return queued
    plan = _ptrace_plan(pid, runtime) if platform.machine() == "x86_64" else None
    if plan is not None:
        return _inject_ptrace(pid, code, plan, wait_seconds)
    return _inject_gdb(pid, code, wait_seconds)


class _Bootstrap:
    """A script file the target will open, and its removal.

    Kept by a directory descriptor on the /tmp that holds it, so removal still works
    after the target has exited and its /proc/<pid>/root is gone.
    """

    def __init__(self, tmp: str, seen_as_tmp: str, code: str) -> None:
        self._tmp_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        self._lock = threading.Lock()
        try:
            # The agent's pid in the name: a later agent removes it once this one is gone.
            self._name = f"dlprof-bootstrap-{os.getpid()}-{secrets.token_hex(8)}"
            os.mkdir(self._name, 0o700, dir_fd=self._tmp_fd)
            # The target may run as another user: it may open the file, nobody may list.
            os.chmod(self._name, 0o711, dir_fd=self._tmp_fd)
            script = os.open(f"{self._name}/bootstrap.py",
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                             dir_fd=self._tmp_fd)
            with open(script, "w", encoding="utf-8") as file:
                file.write(code)
                os.fchmod(file.fileno(), 0o644)
        except BaseException:
            self.remove()
            raise
        self.seen_as = f"{seen_as_tmp.rstrip('/')}/{self._name}/bootstrap.py"

    def remove(self) -> None:
        with self._lock:
            if self._tmp_fd < 0:
                return
            for path, remove in ((f"{self._name}/bootstrap.py", os.unlink),
                                 (self._name, os.rmdir)):
                with contextlib.suppress(OSError):
                    remove(path, dir_fd=self._tmp_fd)
            os.close(self._tmp_fd)
            self._tmp_fd = -1


def _write_bootstrap(pid: int, code: str, *, procfs: str = "/proc") -> _Bootstrap:
    """Write ``code`` to a file process ``pid`` can open (at ``.seen_as``).

    Prefers the target's own /tmp, reached through /proc/<pid>/root, so a job in another
    container sees the file; falls back to the agent's temporary directory.
    """
    try:
        return _Bootstrap(f"{procfs}/{pid}/root/tmp", "/tmp", code)
    except OSError:
        local = tempfile.gettempdir()
        return _Bootstrap(local, local, code)


_BOOTSTRAP_DIR = re.compile(r"dlprof-bootstrap-(?:(\d+)-)?[0-9a-f]{16}")
_OLD_GDB_SCRIPT = re.compile(r"tmp[a-z0-9_]{8}\.gdb")  # written by agents before 0.x
_OLD_GDB_SCRIPT_SIGN = b"echo dlprof-agent: probe bootstrap ran"
_OLD_GDB_SCRIPT_SECONDS = 60.0  # those agents removed theirs within 20 s


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_in(tmp: str, now: float) -> list[str]:
    """Remove, from directory ``tmp``, bootstrap folders and gdb scripts that an agent
    killed mid-injection left: only ours (our uid, no symbolic links), only once the
    agent named in them is gone and the job has had BOOTSTRAP_FILE_SECONDS to read them."""
    removed: list[str] = []
    try:
        tmp_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return removed
    try:
        for name in os.listdir(tmp_fd):
            folder = _BOOTSTRAP_DIR.fullmatch(name)
            if folder is None and _OLD_GDB_SCRIPT.fullmatch(name) is None:
                continue
            try:
                info = os.stat(name, dir_fd=tmp_fd, follow_symlinks=False)
            except OSError:
                continue
            if info.st_uid != os.geteuid():
                continue
            age = now - info.st_mtime
            if folder is not None:
                owner = folder.group(1)
                if (not stat.S_ISDIR(info.st_mode) or age < BOOTSTRAP_FILE_SECONDS
                        or (owner is not None and _pid_alive(int(owner)))):
                    continue
                with contextlib.suppress(OSError):
                    os.unlink(f"{name}/bootstrap.py", dir_fd=tmp_fd)
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=tmp_fd)
                    removed.append(name)
            elif stat.S_ISREG(info.st_mode) and age >= _OLD_GDB_SCRIPT_SECONDS:
                try:
                    script = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=tmp_fd)
                except OSError:
                    continue
                with open(script, "rb") as file:
                    ours = _OLD_GDB_SCRIPT_SIGN in file.read(4096)
                if ours:
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=tmp_fd)
                        removed.append(name)
    finally:
        os.close(tmp_fd)
    return removed


def remove_stale_files(pid: int | None = None, *, now: float | None = None) -> list[str]:
    """Clean what agents killed during an injection left in the temporary directory
    (and in the /tmp of process ``pid``, which may be another container's). Safe to
    call any time: it removes only files of dead agents. Returns the names removed."""
    when = time.time() if now is None else now
    places = [tempfile.gettempdir()]
    if pid is not None:
        places.append(f"/proc/{pid}/root/tmp")
    seen: set[tuple[int, int]] = set()
    removed: list[str] = []
    for place in places:
        try:
            info = os.stat(place)
        except OSError:
            continue
        if (info.st_dev, info.st_ino) not in seen:
            seen.add((info.st_dev, info.st_ino))
            removed += _remove_stale_in(place, when)
    return removed


def _remove_later(bootstrap: _Bootstrap, seconds: float) -> None:
    # remote_exec returns before the target has read the file; give it time to reach a
    # safe point, and clean up at exit should the agent stop sooner.
    timer = threading.Timer(seconds, bootstrap.remove)
    timer.daemon = True
    timer.start()
    atexit.register(bootstrap.remove)


def _inject_remote_exec(pid: int, code: str, remote_exec: Callable[[int, str], object]) -> None:
    try:
        bootstrap = _write_bootstrap(pid, code)
    except OSError as error:
        raise InjectionFailed(f"cannot write the bootstrap script: {_first_line(error)}",
                              "make a temporary directory writable (TMPDIR)") from None
    _remove_later(bootstrap, BOOTSTRAP_FILE_SECONDS)
    try:
        remote_exec(pid, bootstrap.seen_as)
    except ProcessLookupError:
        raise TargetNotFound(f"process {pid} exited before the probe could be injected",
                             "attach to a running job") from None
    except PermissionError:
        raise _refused(pid, "/proc", "sys.remote_exec was denied") from None
    except (OSError, RuntimeError, ValueError) as error:
        raise InjectionFailed(f"sys.remote_exec into process {pid} failed: {_first_line(error)}",
                              "the job must not disable remote debugging "
                              "(PYTHON_DISABLE_REMOTE_DEBUG, -X disable_remote_debug)") from None


# --- gdb: queue the bootstrap as a pending call ----------------------------------------

GDB_WAIT_SECONDS = 10.0  # for the job's main thread to be seen waiting in the kernel
GDB_SESSION_SECONDS = 30.0  # a session takes milliseconds; this only bounds a stuck gdb
GDB_MARK = "dlprof-agent:"
_POLL_SECONDS = 0.005
_FLAG_BYTES = 16  # at the start of the page: the job writes b"ran" there; the code follows
_ADDRESS_PLACEHOLDER = "0xDLPROFAGENTADDR0"  # as wide as "%#018x" of a 64-bit address
_RAN = b"ran"

# Runs inside the target as PyRun_SimpleString(page + 16), from the main thread's eval
# loop with the GIL held. It must never let an exception out: PyRun_SimpleString would
# return -1, which the eval loop turns into a SystemError in the job (and a SystemExit
# would end it). Both levels run in their own namespaces: nothing lands in __main__.
_PENDING_BODY = """\
try:
    with open('/proc/self/mem', 'r+b', buffering=0) as mem:
        mem.seek({address})
        mem.write({ran!r})
except Exception:
    pass
try:
    exec({code!r}, {{'__name__': 'dlprof_agent_injected'}})
except BaseException as error:
    try:
        if isinstance(error, KeyboardInterrupt):
            __import__('_thread').interrupt_main()  # the job's Ctrl-C, handed back
        else:
            __import__('traceback').print_exc()
    except BaseException:
        pass
"""
_PENDING_SOURCE = """\
try:
    exec({body!r}, {{'__name__': 'dlprof_agent_injected'}})
except BaseException:
    pass
"""

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


@dataclass(frozen=True)
class QueuedBootstrap:
    """A bootstrap queued in a job as a pending call: the job runs it when its main
    thread next executes Python bytecode, which may be much later (a long C call)."""

    pid: int
    start_time: int  # field 22 of /proc/<pid>/stat: tells the job from a reused pid
    address: int  # of the page in the job holding the flag and the code
    queued_at: float  # time.monotonic() in the agent

    def state(self) -> str:
        """"queued", "ran" (the job has started running the code), or "gone"."""
        if _start_time(self.pid) != self.start_time:
            return "gone"
        try:
            with open(f"/proc/{self.pid}/mem", "rb", buffering=0) as memory:
                memory.seek(self.address)
                flag = memory.read(len(_RAN))
        except OSError:
            return "gone" if _start_time(self.pid) != self.start_time else "queued"
        return "ran" if flag == _RAN else "queued"


_queued: dict[int, QueuedBootstrap] = {}
_queued_lock = threading.Lock()


def pending_bootstrap(pid: int) -> QueuedBootstrap | None:
    """The bootstrap this agent queued in process ``pid`` that the job has not run yet.
    Injecting again meanwhile queues nothing: ``inject`` returns this one."""
    with _queued_lock:
        queued = _queued.get(pid)
    if queued is None:
        return None
    if queued.state() != "queued":
        with _queued_lock:
            if _queued.get(pid) is queued:
                del _queued[pid]
        return None
    return queued


def _start_time(pid: int) -> int | None:
    text = _read_text(f"/proc/{pid}/stat")
    if text is None:
        return None
    fields = text.rpartition(")")[2].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _pending_payload(code: str) -> bytes:
    body = _PENDING_BODY.format(address=_ADDRESS_PLACEHOLDER, ran=_RAN, code=code)
    source = _PENDING_SOURCE.format(body=body).encode("utf-8")
    return bytes(_FLAG_BYTES) + source + b"\0"


def _threads_in_kernel(pid: int) -> int:
    """How many threads of ``pid`` wait in a system call now (/proc/<pid>/task/*/syscall
    gives its number then; "running" or -1 otherwise). Raises TargetNotFound."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tasks = []
    waiting = 0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/syscall", encoding="ascii") as file:
                fields = file.read().split()
        except PermissionError:
            raise _refused(pid, "/proc", "cannot read the state of its threads") from None
        except OSError:
            continue
        waiting += bool(fields) and fields[0] not in ("running", "-1")
    if not tasks or read_state(pid) in (None, "Z", "X"):
        _raise_if_gone(pid, "/proc")
    return waiting


def _wait_for_a_thread_in_kernel(pid: int, deadline: float) -> bool:
    while not _threads_in_kernel(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_SECONDS)
    return True


def _not_now(pid: int, seconds: float) -> InjectionNotNow:
    return InjectionNotNow(
        f"process {pid} reached no safe point to queue the probe within {seconds:g} s "
        "(none of its threads waited in the kernel: it runs Python or native code "
        "without a pause, holding the GIL); nothing was done to it",
        "the agent tries again on its next passes; or start the job with "
        "`dlprof-agent run -- python ...`")


def _gdb_command(gdb: str, pid: int, payload: bytes) -> list[str]:
    script = _GDB_PYTHON.format(
        mark=GDB_MARK, page=mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE,
        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, flag_bytes=_FLAG_BYTES,
        placeholder=_ADDRESS_PLACEHOLDER.encode(), payload_hex=payload.hex())
    return [gdb, "--batch", "--nx", "-iex", "set auto-load off",
            "-iex", "set auto-solib-add off", "-iex", "set debuginfod enabled off",
            # A signal during a call (our SIGINT on a stuck session) unwinds the call.
            "-iex", "set unwindonsignal on",
            "-p", str(pid), "-ex", f"python exec(bytes.fromhex('{script.encode().hex()}'))"]


def _inject_gdb(pid: int, code: str, wait_seconds: float) -> QueuedBootstrap:
    gdb = shutil.which("gdb")
    if gdb is None:
        raise InjectionFailed(
            f"cannot inject into process {pid}: gdb is not installed",
            "install it (e.g. apt install gdb) to inject into a running Python before 3.14, "
            "or start the job with `dlprof-agent run -- python ...`")
    queued = pending_bootstrap(pid)
    if queued is not None:
        return queued
    start_time = _start_time(pid)
    command = _gdb_command(gdb, pid, _pending_payload(code))
    deadline = time.monotonic() + wait_seconds
    while True:
        if not _wait_for_a_thread_in_kernel(pid, deadline):
            raise _not_now(pid, wait_seconds)
        output = _run_gdb(pid, command)
        verdict = next((line.split()[1:] for line in output.splitlines()
                        if line.startswith(GDB_MARK + " ")), None)
        if verdict and verdict[0] == "no-thread-in-kernel" and time.monotonic() < deadline:
            continue  # it left the kernel between our look and gdb's stop: look again
        break
    if verdict and verdict[0] == "queued" and len(verdict) == 3:
        if verdict[2] != "0":
            raise InjectionNotNow(f"process {pid} has a full queue of pending calls",
                                  "the agent tries again on its next passes")
        queued = QueuedBootstrap(pid, start_time or 0, int(verdict[1], 16), time.monotonic())
        with _queued_lock:
            _queued[pid] = queued
        return queued
    if _start_time(pid) != start_time or read_state(pid) in (None, "Z", "X"):
        raise TargetNotFound(f"process {pid} exited during the injection",
                             "attach to a running job")
    if "ptrace: Operation not permitted" in output:
        raise _refused(pid, "/proc", "ptrace was denied")
    if verdict and verdict[0] == "no-thread-in-kernel":
        raise _not_now(pid, wait_seconds)
    detail = (" ".join(verdict) if verdict else None) or next(
        (line.strip() for line in output.splitlines()
         if "rror" in line or "not defined" in line), "gdb gave up")
    raise InjectionFailed(f"injecting into process {pid} failed: {detail}",
                          "start the job with `dlprof-agent run -- python ...` instead")


def _run_gdb(pid: int, command: list[str]) -> str:
    # gdb gets its own session so that a Ctrl-C meant for the agent does not stop it
    # halfway; a kill of the whole agent side is what the design above makes safe.
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


# --- ptrace (x86-64): borrow a waiting thread; it puts itself back -------------------------

_PTRACE_GETREGS, _PTRACE_SETREGS, _PTRACE_GETFPREGS, _PTRACE_DETACH = 12, 13, 14, 17
_PTRACE_SEIZE, _PTRACE_INTERRUPT = 0x4206, 0x4207
_PTRACE_EVENT_STOP = 128
_WALL = 0x40000000
_MAP_FIXED_NOREPLACE = 0x100000  # Linux 4.17+: never replaces a mapping of the job
# struct user_regs_struct, in order
_REGS = ("r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx",
         "rdx", "rsi", "rdi", "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base",
         "gs_base", "ds", "es", "fs", "gs")
# mov $15,%rax; syscall (and the %eax form): rt_sigreturn, as libc's signal restorer does it
_SIGRETURN = (b"\x48\xc7\xc0\x0f\x00\x00\x00\x0f\x05", b"\xb8\x0f\x00\x00\x00\x0f\x05")
# System calls a waiting thread may be borrowed from: none of them changes the signal mask
# for its duration (ppoll, pselect, epoll_pwait and sigsuspend do), and the kernel restarts
# or fails each of them the same way after our detour as after any ptrace stop.
_BORROWABLE = frozenset({0, 7, 23, 35, 43, 45, 47, 61, 202, 230, 232, 247, 288})
# These change it only when given a mask: pselect6, ppoll, epoll_pwait, epoll_pwait2, and
# the index of that argument (Python's time.sleep is pselect6 with none, on some builds).
_MASK_ARGUMENT = {270: 5, 271: 3, 281: 4, 441: 4}


def _borrowable(number: int, arguments: list[int]) -> bool:
    if number in _BORROWABLE:
        return True
    index = _MASK_ARGUMENT.get(number)
    return index is not None and index < len(arguments) and arguments[index] == 0
_ERESTART_CODES = (-512, -513, -514)  # ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND
# A call the kernel resumes through restart_syscall (a relative sleep, a futex or poll
# with a timeout) is never borrowed: rt_sigreturn turns that resumption into EINTR.
_ERESTART_RESTARTBLOCK = -516
_SYSCALL_ARGUMENTS = ("rdi", "rsi", "rdx", "r10", "r8", "r9")
_CALL_ARGUMENTS = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")
_RED_ZONE = 128
_FRAME_GAP = 2048  # below the red zone: where the borrowed thread's detour frame goes
_STACK_NEEDED = 64 << 10  # free stack the called function may use below the frame
_USER_SPACE_END = 1 << 47  # x86-64 with 4-level page tables, as mmap hands out by default
_CHAIN_SECONDS = 5.0  # for a borrowed thread to be scheduled and finish its detour


class _Ptrace:
    def __init__(self) -> None:
        import ctypes

        self._ctypes = ctypes
        call = ctypes.CDLL(None, use_errno=True).ptrace
        call.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        call.restype = ctypes.c_long
        self._call = call

    def __call__(self, request: int, tid: int, data: object = None) -> None:
        self._ctypes.set_errno(0)
        if self._call(request, tid, None, data) == -1:
            error = self._ctypes.get_errno()
            raise OSError(error, os.strerror(error))

    def registers(self, tid: int) -> list[int]:
        regs = (self._ctypes.c_ulonglong * len(_REGS))()
        self(_PTRACE_GETREGS, tid, self._ctypes.addressof(regs))
        return list(regs)

    def set_registers(self, tid: int, values: list[int]) -> None:
        regs = (self._ctypes.c_ulonglong * len(_REGS))(*values)
        self(_PTRACE_SETREGS, tid, self._ctypes.addressof(regs))  # all of them, at once

    def fxsave(self, tid: int) -> bytes:
        area = (self._ctypes.c_ubyte * 512)()
        self(_PTRACE_GETFPREGS, tid, self._ctypes.addressof(area))
        return bytes(area)


def _signed(register: int) -> int:
    return register - (1 << 64) if register >= 1 << 63 else register


def _signal_frame(at: int, regs: list[int], fxsave: bytes, blocked: int, gadget: int) -> bytes:
    """What the borrowed thread finds on its stack at ``at`` when the called function
    returns: the address of an rt_sigreturn, then the frame that call restores, which is
    the thread as we stopped it, its interrupted system call set to run again."""
    r = dict(zip(_REGS, regs, strict=True))
    rax, rip = r["rax"], r["rip"]
    if _signed(rax) in _ERESTART_CODES:
        rax, rip = r["orig_rax"], rip - 2  # as the kernel restarts it after a ptrace stop
    fx_at = -(-(at + 8 + 304) // 64) * 64
    context = struct.pack(
        "<18Q4H4QQ8Q", r["r8"], r["r9"], r["r10"], r["r11"], r["r12"], r["r13"], r["r14"],
        r["r15"], r["rdi"], r["rsi"], r["rbp"], r["rbx"], r["rdx"], rax, r["rcx"], r["rsp"],
        rip, r["eflags"], r["cs"], 0, 0, r["ss"], 0, 0, 0, 0, fx_at, *([0] * 8))
    # uc_flags UC_SIGCONTEXT_SS | UC_STRICT_RESTORE_SS; uc_stack with an invalid ss_flags,
    # so the kernel keeps the thread's signal stack as it is (it ignores that error).
    ucontext = struct.pack("<QQQiiQ", 6, 0, 0, 0x10, 0, 0) + context + struct.pack("<Q", blocked)
    frame = struct.pack("<Q", gadget) + ucontext
    # The FXSAVE image without the XSAVE marker: x87, SSE and MXCSR come back as they were.
    return frame + bytes(fx_at - at - len(frame)) + fxsave[:464] + bytes(48)


def _maps(pid: int) -> list[tuple[int, int, str, int, str]]:
    """(start, end, permissions, offset, path) of each mapping of ``pid``."""
    text = _read_text(f"/proc/{pid}/maps") or ""
    mappings = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 5:
            continue
        start, _, end = fields[0].partition("-")
        mappings.append((int(start, 16), int(end, 16), fields[1], int(fields[2], 16),
                         fields[5] if len(fields) == 6 else ""))
    return mappings


def _read_memory(pid: int, address: int, size: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as memory:
        memory.seek(address)
        return memory.read(size)


def _write_memory(pid: int, address: int, data: bytes) -> None:
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as memory:
        memory.seek(address)
        if memory.write(data) != len(data):
            raise OSError(f"short write to process {pid}")


def _function_address(pid: int, maps: list[tuple[int, int, str, int, str]], path: str,
                      file: str, name: str) -> int | None:
    """Where ``name``, defined in ``file`` (mapped as ``path``), is in process ``pid``;
    None unless the bytes there are the file's own (a wrong address is never called)."""
    scan = _open_scan(file)
    location = scan.location(name) if scan is not None else None
    if scan is None or location is None:
        return None
    value, offset = location
    base = 0
    if scan.shared:
        starts = [start for start, _, _, map_offset, mapped in maps
                  if mapped == path and map_offset == 0]
        if not starts:
            return None
        base = min(starts)
    try:
        with open(file, "rb") as source:
            source.seek(offset)
            expected = source.read(16)
        if len(expected) < 16 or _read_memory(pid, base + value, 16) != expected:
            return None
    except OSError:
        return None
    return base + value


def _libc_path(maps: list[tuple[int, int, str, int, str]]) -> str | None:
    for *_, path in maps:
        name = os.path.basename(path)
        if name.startswith(("libc.so", "libc-2.", "ld-musl-")):
            return path
    return None


def _find_sigreturn(pid: int, maps: list[tuple[int, int, str, int, str]], libc: str) -> int | None:
    for start, end, permissions, _, path in maps:
        if path != libc or "x" not in permissions or end - start > _MAX_TABLE_BYTES:
            continue
        try:
            code = _read_memory(pid, start, end - start)
        except OSError:
            continue
        for gadget in _SIGRETURN:
            at = code.find(gadget)
            if at >= 0:
                return start + at
    return None


def _free_address(maps: list[tuple[int, int, str, int, str]], size: int) -> int | None:
    """The middle of the widest gap between the job's mappings, away from any of them."""
    best: tuple[int, int] | None = None
    user = [mapping for mapping in maps if mapping[1] <= _USER_SPACE_END]  # not [vsyscall]
    for (_, end, *_), (start, *_) in itertools.pairwise(user):
        if end >= 1 << 32 and start - end >= 64 * size and (best is None or
                                                           start - end > best[1] - best[0]):
            best = (end, start)
    if best is None:
        return None
    return (best[0] + (best[1] - best[0]) // 2) // mmap.PAGESIZE * mmap.PAGESIZE


def _blocked_signals(pid: int, tid: int) -> int | None:
    value = _status_field(f"{pid}/task/{tid}", "SigBlk", "/proc")
    try:
        return int(value, 16) if value is not None else None
    except ValueError:
        return None


def _waiting_threads(pid: int) -> list[int]:
    """Threads of ``pid`` waiting in a system call we may borrow them from, main first."""
    found = []
    try:
        tasks = sorted((int(task) for task in os.listdir(f"/proc/{pid}/task")),
                       key=lambda tid: tid != pid)
    except (OSError, ValueError):
        return []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall", encoding="ascii") as file:
                fields = file.read().split()
        except PermissionError:
            raise _refused(pid, "/proc", "cannot read the state of its threads") from None
        except OSError:
            continue
        try:
            number, arguments = int(fields[0]), [int(field, 16) for field in fields[1:7]]
        except (IndexError, ValueError):
            continue  # "running", or -1: not in a system call
        task_state = (_read_text(f"/proc/{pid}/task/{tid}/stat") or ")").rpartition(")")[2]
        # Interruptible sleep only: a thread in uninterruptible sleep (D, disk or NFS I/O)
        # would keep the agent waiting for its stop.
        if _borrowable(number, arguments) and task_state.split()[:1] == ["S"]:
            found.append(tid)
    return found


def _detour(ptrace: _Ptrace, pid: int, tid: int, call: tuple[int, tuple[int, ...], int],
            maps: list[tuple[int, int, str, int, str]]) -> bool:
    """With ``tid`` stopped by us: point it at ``function(*args)``, returning into
    rt_sigreturn with a frame that restores it. Leaves it untouched and returns False
    when it is not waiting in a system call we may borrow it from. ``call`` is the
    function's address, its arguments, and the address of an rt_sigreturn."""
    function, args, gadget = call
    regs = ptrace.registers(tid)
    r = dict(zip(_REGS, regs, strict=True))
    orig = _signed(r["orig_rax"])
    arguments = [r[name] for name in _SYSCALL_ARGUMENTS]
    if (orig < 0 or _signed(r["rax"]) == _ERESTART_RESTARTBLOCK
            or not _borrowable(orig, arguments)):
        return False
    blocked = _blocked_signals(pid, tid)
    at = ((r["rsp"] - _RED_ZONE - _FRAME_GAP) & ~15) - 8  # a call's entry: rsp % 16 == 8
    stack = next(((start, end) for start, end, *_ in maps if start <= r["rsp"] < end), None)
    if blocked is None or stack is None or at - _STACK_NEEDED < stack[0]:
        return False
    frame = _signal_frame(at, regs, ptrace.fxsave(tid), blocked, gadget)
    if at + len(frame) > r["rsp"] - _RED_ZONE:
        return False
    _write_memory(pid, at, frame)
    new = dict(r, rsp=at, rip=function, rax=0, orig_rax=(1 << 64) - 1)
    for register, value in zip(_CALL_ARGUMENTS, args, strict=False):
        new[register] = value % (1 << 64)
    ptrace.set_registers(tid, [new[name] for name in _REGS])
    return True


def _borrow_a_thread(ptrace: _Ptrace, pid: int, function: int, args: tuple[int, ...],
                     gadget: int) -> bool:
    """Have one waiting thread of ``pid`` call ``function(*args)`` and go back to its wait.
    Only that thread stops, for microseconds; it needs nothing more from us once it is
    set on its way, so the agent may die at any moment. False when none could be had."""
    maps = _maps(pid)
    for tid in _waiting_threads(pid):
        try:
            ptrace(_PTRACE_SEIZE, tid)
        except OSError as error:
            if error.errno == errno.EPERM:
                raise _refused(pid, "/proc", "ptrace was denied") from None
            continue
        stopped, signal_to_pass = False, 0
        try:
            ptrace(_PTRACE_INTERRUPT, tid)
            _, status = os.waitpid(tid, _WALL)
            if not os.WIFSTOPPED(status):
                continue
            stopped = True
            if status >> 16 != _PTRACE_EVENT_STOP:
                signal_to_pass = os.WSTOPSIG(status)  # a signal arrived meanwhile: pass it on
                continue
            if os.WSTOPSIG(status) != signal.SIGTRAP:
                continue  # a group stop (someone stopped the job): leave it as it is
            if _detour(ptrace, pid, tid, (function, args, gadget), maps):
                return True
        except OSError:
            continue
        finally:
            _release(ptrace, tid, stopped, signal_to_pass)
    return False


def _release(ptrace: _Ptrace, tid: int, stopped: bool, signal_to_pass: int) -> None:
    # Detaching needs a stopped tracee; one left seized would stop at its next signal.
    with contextlib.suppress(OSError, ChildProcessError):
        if not stopped:
            ptrace(_PTRACE_INTERRUPT, tid)
            _, status = os.waitpid(tid, _WALL)
            if not os.WIFSTOPPED(status):
                return
            if status >> 16 != _PTRACE_EVENT_STOP:
                signal_to_pass = os.WSTOPSIG(status)
        ptrace(_PTRACE_DETACH, tid, signal_to_pass)


def _ptrace_plan(pid: int, runtime: PythonRuntime) -> tuple[int, int, int, int] | None:
    """Addresses in ``pid`` of Py_AddPendingCall, PyRun_SimpleString, mmap and an
    rt_sigreturn; None when one cannot be found and checked (then gdb is used)."""
    maps = _maps(pid)
    libc = _libc_path(maps)
    if libc is None:
        return None
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None
    python_file = (f"/proc/{pid}/exe" if runtime.library == exe
                   else f"/proc/{pid}/root{runtime.library}")
    add = _function_address(pid, maps, runtime.library, python_file, "Py_AddPendingCall")
    run = _function_address(pid, maps, runtime.library, python_file, "PyRun_SimpleString")
    allocate = _function_address(pid, maps, libc, f"/proc/{pid}/root{libc}", "mmap")
    gadget = _find_sigreturn(pid, maps, libc)
    if add is None or run is None or allocate is None or gadget is None:
        return None
    return add, run, allocate, gadget


def _inject_ptrace(pid: int, code: str, plan: tuple[int, int, int, int],
                   wait_seconds: float) -> QueuedBootstrap:
    add, run, allocate, gadget = plan
    start_time = _start_time(pid)
    payload = _pending_payload(code)
    size = -(-len(payload) // mmap.PAGESIZE) * mmap.PAGESIZE
    ptrace = _Ptrace()
    deadline = time.monotonic() + wait_seconds

    def borrow(function: int, args: tuple[int, ...]) -> None:
        while not _borrow_a_thread(ptrace, pid, function, args, gadget):
            if _start_time(pid) != start_time or read_state(pid) in (None, "Z", "X"):
                raise TargetNotFound(f"process {pid} exited during the injection",
                                     "attach to a running job")
            if time.monotonic() >= deadline:
                raise _not_now(pid, wait_seconds)
            time.sleep(_POLL_SECONDS)

    page = _free_address(_maps(pid), size)
    if page is None:
        raise InjectionFailed(f"found no free address range in process {pid}",
                              "start the job with `dlprof-agent run -- python ...` instead")
    borrow(allocate, (page, size, mmap.PROT_READ | mmap.PROT_WRITE,
                      mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED_NOREPLACE, -1, 0))
    chain_deadline = time.monotonic() + _CHAIN_SECONDS
    while not any(start == page for start, *_ in _maps(pid)):
        if _start_time(pid) != start_time or read_state(pid) in (None, "Z", "X"):
            raise TargetNotFound(f"process {pid} exited during the injection",
                                 "attach to a running job")
        if time.monotonic() >= chain_deadline:
            raise InjectionNotNow(f"process {pid} did not map a page for the probe's bootstrap",
                                  "the agent tries again on its next passes")
        time.sleep(_POLL_SECONDS)
    _write_memory(pid, page, payload.replace(_ADDRESS_PLACEHOLDER.encode(),
                                             f"{page:#018x}".encode(), 1))
    borrow(add, (run, page + _FLAG_BYTES))
    queued = QueuedBootstrap(pid, start_time or 0, page, time.monotonic())
    with _queued_lock:
        _queued[pid] = queued
    return queued
