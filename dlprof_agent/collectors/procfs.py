"""The agent's /proc reader: every module but the injector's asks here for what it
needs from /proc. The injector's own front is ``reach/procfs.py``, which reuses the
parsers here; ``tests/test_procfs.py`` checks that no other module builds a /proc path.

Kept in one file: the parsers of the files it reads and the per-pass cache sit
together with the readers.

Each ``read_*`` function takes the procfs root (``root``: ``PROC_ROOT`` by default, a
captured tree in tests) and returns a typed record. They agree on two rules:

- a process or thread that has gone (ENOENT or ESRCH on its files) raises
  ``TargetGone``; a file missing from a process that is still there (``io``
  without I/O accounting) is None;
- a file the agent may not read (EACCES: another user's ``environ`` or ``io``)
  is None, never a traceback.

``ProcessFiles`` is psutil's ``oneshot()`` for these files: one object per target
per sampling pass, which reads each file at most once, however many collectors
ask for it.

psutil is left only where procfs does not say a thing plainly: the core counts
(``collectors/host.py``).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO, TypeVar

from dlprof_agent.errors import TargetGone

PROC_ROOT = "/proc"

CLOCK_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PAGE_SIZE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

# /proc/<pid>/environ can hold megabytes (a job that exports a whole dataset list).
# It is read in chunks, each value is kept up to ENVIRON_VALUE_MAX_CHARS characters,
# at most ENVIRON_MAX_ENTRIES variables are kept and at most ENVIRON_MAX_BYTES read.
ENVIRON_VALUE_MAX_CHARS = 4096
ENVIRON_MAX_ENTRIES = 4096
ENVIRON_MAX_BYTES = 8 << 20
_ENVIRON_CHUNK_BYTES = 64 << 10
_ENVIRON_ENTRY_MAX_BYTES = 4 * ENVIRON_VALUE_MAX_CHARS  # UTF-8: up to 4 bytes a character

_GONE = (errno.ENOENT, errno.ESRCH)
_T = TypeVar("_T")

# One mapping of /proc/<pid>/maps: start, end, permissions, file offset, path ("" if none).
Mapping = tuple[int, int, str, int, str]


@dataclass(frozen=True, slots=True)
class Stat:
    """/proc/<pid>/stat, or a thread's /proc/<pid>/task/<tid>/stat."""

    pid: int
    comm: str  # the name, up to 15 bytes; for a thread, the thread's own name
    state: str  # R runs or waits for a CPU, S sleeps, D waits on I/O, Z zombie, ...
    ppid: int
    user_seconds: float
    system_seconds: float
    threads: int
    start_ticks: int  # clock ticks since boot: a pid reused by another process has another
    vms_bytes: int
    rss_bytes: int
    iowait_seconds: float  # delay accounting's block-I/O wait; 0 where the kernel lacks it


@dataclass(frozen=True, slots=True)
class Status:
    """The fields of /proc/<pid>/status the agent uses; None where the line is absent."""

    name: str
    state: str  # its letter
    ppid: int
    tracer_pid: int
    uids: tuple[int, ...]  # real, effective, saved, filesystem
    nspid: tuple[int, ...]  # the pid in each pid namespace, outermost first
    threads: int | None
    vm_hwm_bytes: int | None  # resident high-water mark since the process started
    vm_rss_bytes: int | None
    voluntary_context_switches: int | None
    involuntary_context_switches: int | None
    sig_blk: int | None  # blocked signals, a bit mask
    cap_prm: int | None  # permitted capabilities, a bit mask
    cap_eff: int | None  # effective capabilities, a bit mask


@dataclass(frozen=True, slots=True)
class ThreadStat:
    """One thread from its task stat file, CPU in seconds."""

    tid: int
    name: str
    user_seconds: float
    system_seconds: float
    iowait_seconds: float
    state: str = ""  # scheduler state at the read: R runs or waits for a CPU, S sleeps, ...


@dataclass(frozen=True, slots=True)
class Io:
    """/proc/<pid>/io, in bytes."""

    read_chars: int  # passed to read-like syscalls, page-cache hits included
    write_chars: int
    read_syscalls: int
    write_syscalls: int
    read_bytes: int  # from storage
    write_bytes: int
    cancelled_write_bytes: int


@dataclass(frozen=True, slots=True)
class Schedstat:
    """/proc/<pid>/schedstat: the scheduler's times of one task (for a process, its main
    thread), in seconds since it started."""

    run_seconds: float  # on a CPU
    wait_seconds: float  # runnable, waiting in a run queue for a CPU


@dataclass(frozen=True, slots=True)
class CgroupEntry:
    """One line of /proc/<pid>/cgroup."""

    hierarchy: int  # 0 for cgroup v2
    controllers: tuple[str, ...]  # empty for cgroup v2
    path: str


@dataclass(frozen=True, slots=True)
class ResourceLimit:
    """One line of /proc/<pid>/limits; None means unlimited."""

    soft: int | None
    hard: int | None
    unit: str  # "seconds", "bytes", "files", ... or "" where the kernel gives none


def proc_path(*parts: object, root: str = PROC_ROOT) -> str:
    """``root/part/part...``: e.g. ``proc_path(pid, "task")``, ``proc_path("self", "mounts")``."""
    return "/".join((root, *(str(part) for part in parts)))


def _process_dir(pid: int | str, tid: int | None, root: str) -> str:
    return f"{root}/{pid}" if tid is None else f"{root}/{pid}/task/{tid}"


def _translate(error: OSError, pid: int | str, tid: int | None, root: str) -> None:
    """Raise TargetGone for a process or thread that has gone; return for EACCES or a
    file this kernel lacks (the caller returns None); re-raise anything else."""
    if isinstance(error, PermissionError):
        return
    if error.errno in _GONE:
        if error.errno == errno.ENOENT and os.path.isdir(_process_dir(pid, tid, root)):
            return  # the process is there; this file is not
        raise TargetGone(pid if isinstance(pid, int) else os.getpid()) from None
    raise error


# Most of these files fit one read; a larger one (maps, a long status) is read on.
_READ_CHUNK_BYTES = 4096
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


def read_file_bytes(path: str, limit: int = -1, *, records: bool = False) -> bytes:
    """A whole file (or its first ``limit`` bytes) through plain os.open and os.read:
    a file object's buffer and wrapper cost more than the read itself on these
    small files, read thousands of times a minute. The kernel writes most of them
    in one go, so a read shorter than asked for is their end; ``records``: a file
    it writes a record at a time (maps), whose reads can end short before its end,
    is read until a read returns nothing. Raises OSError as open() does."""
    fd = os.open(path, _OPEN_FLAGS)
    try:
        chunks: list[bytes] = []
        total = 0
        while limit < 0 or total < limit:
            want = _READ_CHUNK_BYTES if limit < 0 else min(limit - total, _READ_CHUNK_BYTES)
            chunk = os.read(fd, want)
            if not chunks and ((len(chunk) < want and not records) or len(chunk) == limit):
                return chunk  # the common case: one read, no join
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if len(chunk) < want and not records:
                break
        return b"".join(chunks)
    finally:
        os.close(fd)


def _read_bytes(pid: int | str, name: str, *, tid: int | None = None,
                root: str = PROC_ROOT, limit: int = -1, records: bool = False) -> bytes | None:
    try:
        return read_file_bytes(f"{_process_dir(pid, tid, root)}/{name}", limit,
                               records=records)
    except OSError as error:
        _translate(error, pid, tid, root)
        return None


def _read_text(pid: int | str, name: str, *, tid: int | None = None,
               root: str = PROC_ROOT, records: bool = False) -> str | None:
    raw = _read_bytes(pid, name, tid=tid, root=root, records=records)
    return None if raw is None else raw.decode(errors="replace")


def parse_stat(text: str) -> Stat:
    """A stat line. The name sits in parentheses and may hold spaces and ")": the
    fields after it start after the last ")"."""
    pid, _, rest = text.partition(" (")
    comm, _, after = rest.rpartition(")")
    # Fields the line lacks (an older kernel's shorter line) read as 0.
    fields = after.split()
    fields += ["0"] * (40 - len(fields))
    # proc(5) numbers the fields from 1, pid and comm being 1 and 2: field n is fields[n - 3].
    ticks = CLOCK_TICKS_PER_SECOND
    return Stat(
        pid=int(pid), comm=comm, state=fields[0], ppid=int(fields[1]),
        user_seconds=int(fields[11]) / ticks, system_seconds=int(fields[12]) / ticks,
        threads=int(fields[17]), start_ticks=int(fields[19]), vms_bytes=int(fields[20]),
        rss_bytes=int(fields[21]) * PAGE_SIZE_BYTES,
        iowait_seconds=int(fields[39]) / ticks)


def read_stat(pid: int | str, *, tid: int | None = None, root: str = PROC_ROOT) -> Stat | None:
    """The process's (or its thread ``tid``'s) stat."""
    text = _read_text(pid, "stat", tid=tid, root=root)
    return None if text is None else parse_stat(text)


def read_state(pid: int, *, root: str = PROC_ROOT) -> str | None:
    """The one-letter scheduler state of ``pid``, None when there is no such process.
    Z (zombie) and X (dead) mean it has exited."""
    try:
        stat = read_stat(pid, root=root)
    except (TargetGone, ValueError, IndexError):
        return None
    return None if stat is None else stat.state


def _hex(value: str | None) -> int | None:
    return None if value is None else int(value, 16)


def _kib(value: str | None) -> int | None:
    return None if value is None else int(value.split()[0]) * 1024


def _int(value: str | None) -> int | None:
    return None if value is None else int(value)


def parse_status(text: str) -> Status:
    lines = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        lines[key] = value.strip()
    return Status(
        name=lines.get("Name", ""), state=lines.get("State", "?")[:1],
        ppid=int(lines.get("PPid", "0")), tracer_pid=int(lines.get("TracerPid", "0")),
        uids=tuple(int(uid) for uid in lines.get("Uid", "").split()),
        nspid=tuple(int(pid) for pid in lines.get("NSpid", "").split()),
        threads=_int(lines.get("Threads")), vm_hwm_bytes=_kib(lines.get("VmHWM")),
        vm_rss_bytes=_kib(lines.get("VmRSS")),
        voluntary_context_switches=_int(lines.get("voluntary_ctxt_switches")),
        involuntary_context_switches=_int(lines.get("nonvoluntary_ctxt_switches")),
        sig_blk=_hex(lines.get("SigBlk")), cap_prm=_hex(lines.get("CapPrm")),
        cap_eff=_hex(lines.get("CapEff")))


def read_status(pid: int | str, *, tid: int | None = None,
                root: str = PROC_ROOT) -> Status | None:
    """The process's (or its thread ``tid``'s) status; ``pid`` may be "self"."""
    text = _read_text(pid, "status", tid=tid, root=root)
    return None if text is None else parse_status(text)


def list_tasks(pid: int, *, root: str = PROC_ROOT) -> list[int]:
    """The thread ids of ``pid``, the main thread first."""
    try:
        names = os.listdir(proc_path(pid, "task", root=root))
    except OSError as error:
        _translate(error, pid, None, root)
        return []
    return sorted((int(name) for name in names if name.isdigit()), key=lambda tid: tid != pid)


def read_task_stats(pid: int, *, root: str = PROC_ROOT) -> tuple[ThreadStat, ...]:
    """Every thread of ``pid``, named by its comm. Threads that end meanwhile are left out."""
    stats = []
    for tid in list_tasks(pid, root=root):
        try:
            stat = read_stat(pid, tid=tid, root=root)
        except TargetGone:
            continue
        if stat is not None:
            stats.append(ThreadStat(tid, stat.comm, stat.user_seconds, stat.system_seconds,
                                    stat.iowait_seconds, stat.state))
    return tuple(stats)


def read_schedstat(pid: int, *, tid: int | None = None, root: str = PROC_ROOT
                   ) -> Schedstat | None:
    """The task's run and run-queue wait times; None where the kernel keeps none
    (built without CONFIG_SCHED_INFO) or the line is not three numbers."""
    text = _read_text(pid, "schedstat", tid=tid, root=root)
    fields = text.split() if text is not None else []
    if len(fields) < 2 or not all(field.isdigit() for field in fields[:2]):
        return None
    return Schedstat(int(fields[0]) / 1e9, int(fields[1]) / 1e9)


def read_io(pid: int, *, root: str = PROC_ROOT) -> Io | None:
    """None without permission (another user's process) or I/O accounting."""
    text = _read_text(pid, "io", root=root)
    if text is None:
        return None
    values = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        values[key] = int(value)
    return Io(values["rchar"], values["wchar"], values["syscr"], values["syscw"],
              values["read_bytes"], values["write_bytes"], values["cancelled_write_bytes"])


def may_read_io(pid: int, *, root: str = PROC_ROOT) -> bool:
    """False when the kernel refuses the agent the process's io file: the check that
    ptrace read access makes (same user, or CAP_SYS_PTRACE). True where it allows it,
    has no I/O accounting or the process has gone (whoever reads next finds that)."""
    try:
        with open(proc_path(pid, "io", root=root), "rb") as file:
            file.read()  # the kernel checks access on read, not on open
    except PermissionError:
        return False
    except OSError:
        return True
    return True


def _environ_entries(file: BinaryIO) -> Iterator[bytes]:
    """The NUL-separated entries of ``file``, each cut at _ENVIRON_ENTRY_MAX_BYTES, reading
    at most ENVIRON_MAX_BYTES: a huge value never sits in memory whole."""
    entry = bytearray()
    left = ENVIRON_MAX_BYTES
    while left > 0:
        chunk = file.read(min(_ENVIRON_CHUNK_BYTES, left))
        if not chunk:
            break
        left -= len(chunk)
        *ended, rest = chunk.split(b"\0")
        for piece in ended:
            entry += piece[:_ENVIRON_ENTRY_MAX_BYTES - len(entry)]
            yield bytes(entry)
            entry.clear()
        entry += rest[:max(0, _ENVIRON_ENTRY_MAX_BYTES - len(entry))]
    if entry:
        yield bytes(entry)


def read_environ(pid: int, *, root: str = PROC_ROOT) -> dict[str, str] | None:
    """The environment the process started with; None when the agent may not read it.
    Bounded: see ENVIRON_VALUE_MAX_CHARS and the limits beside it. The kernel answers
    ESRCH for a zombie's: TargetGone, as for any process that has exited."""
    try:
        with open(proc_path(pid, "environ", root=root), "rb") as file:
            environment: dict[str, str] = {}
            for entry in _environ_entries(file):
                if len(environment) >= ENVIRON_MAX_ENTRIES:
                    break
                name, _, value = entry.partition(b"=")
                if name:
                    environment[name.decode(errors="replace")] = value.decode(
                        errors="replace")[:ENVIRON_VALUE_MAX_CHARS]
            return environment
    except OSError as error:
        _translate(error, pid, None, root)
        return None


def read_cgroups(pid: int, *, root: str = PROC_ROOT) -> tuple[CgroupEntry, ...] | None:
    text = _read_text(pid, "cgroup", root=root)
    if text is None:
        return None
    entries = []
    for line in text.splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        entries.append(CgroupEntry(int(hierarchy), tuple(filter(None, controllers.split(","))),
                                   path))
    return tuple(entries)


def _limit_value(text: str) -> int | None:
    return None if text == "unlimited" else int(text)


def read_limits(pid: int, *, root: str = PROC_ROOT) -> dict[str, ResourceLimit] | None:
    """Resource name ("Max open files") -> its limits."""
    text = _read_text(pid, "limits", root=root)
    if text is None:
        return None
    limits = {}
    for line in text.splitlines()[1:]:  # the first is the header
        # Columns: the name, padded to 26 characters, then soft, hard and the unit.
        name, values = line[:26].strip(), line[26:].split()
        if name and len(values) >= 2:
            limits[name] = ResourceLimit(_limit_value(values[0]), _limit_value(values[1]),
                                         values[2] if len(values) > 2 else "")
    return limits


def count_fds(pid: int, *, root: str = PROC_ROOT) -> int | None:
    """Open file descriptors; None without permission."""
    try:
        return sum(name.isdigit() for name in os.listdir(proc_path(pid, "fd", root=root)))
    except OSError as error:
        _translate(error, pid, None, root)
        return None


def read_unix_sockets(pid: int, *, root: str = PROC_ROOT) -> list[tuple[str, str]]:
    """(inode, path) of every bound Unix socket of ``pid``'s network namespace
    (net/unix); [] where it cannot be read."""
    found = []
    with contextlib.suppress(OSError), open(proc_path(pid, "net", "unix", root=root)) as file:
        for line in file:
            # Num RefCount Protocol Flags Type St Inode Path
            fields = line.rstrip("\n").split(None, 7)
            if len(fields) == 8:
                found.append((fields[6], fields[7]))
    return found


def socket_inodes(pid: int, *, root: str = PROC_ROOT) -> set[str]:
    """The inodes of the sockets ``pid`` itself holds open (fd links "socket:[N]");
    empty where they cannot be read."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(proc_path(pid, "fd", root=root)):
            with contextlib.suppress(OSError):
                link = os.readlink(proc_path(pid, "fd", fd, root=root))
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    return inodes


def list_pids(*, root: str = PROC_ROOT) -> list[int]:
    """Every process's pid (the numbered folders of the procfs root)."""
    return [int(name) for name in os.listdir(root) if name.isdigit()]


def read_boot_time(*, root: str = PROC_ROOT) -> float:
    """When the machine booted, in unix seconds (the btime line of stat): a start in
    clock ticks since boot plus this is a start in unix time, as psutil gives it."""
    for line in read_file_bytes(proc_path("stat", root=root)).splitlines():
        if line.startswith(b"btime"):
            return float(line.split()[1])
    raise OSError(errno.ENODATA, "no btime line", proc_path("stat", root=root))


def read_cmdline_args(pid: int, *, root: str = PROC_ROOT, limit_bytes: int = 4096
                      ) -> list[str] | None:
    """The command line's arguments as psutil splits them (by NUL, or by space when a
    process rewrote its title without one), cut at ``limit_bytes``; None without
    permission."""
    raw = _read_bytes(pid, "cmdline", root=root, limit=limit_bytes)
    if raw is None:
        return None
    text = raw.decode(errors="replace")
    if not text:
        return []
    separator = "\0" if text.endswith("\0") else " "
    args = text.removesuffix(separator).split(separator)
    if separator == "\0" and len(args) == 1 and " " in args[0]:
        return args[0].split(" ")  # a NUL at the end only: a rewritten title
    return args


# The host's CPU modes in /proc/stat's order, as psutil names them.
CPU_TIME_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal",
                   "guest", "guest_nice")


def read_cpu_times(*, root: str = PROC_ROOT) -> tuple[tuple[str, float], ...]:
    """The host's CPU time by mode, in seconds summed over all CPUs (stat's cpu line);
    the modes this kernel has."""
    line = read_file_bytes(proc_path("stat", root=root), 1024).split(b"\n", 1)[0]
    values = line.split()[1:len(CPU_TIME_FIELDS) + 1]
    return tuple((mode, int(value) / CLOCK_TICKS_PER_SECOND)
                 for mode, value in zip(CPU_TIME_FIELDS, values, strict=False))


def read_meminfo(*, root: str = PROC_ROOT) -> dict[str, int]:
    """meminfo's lines, name -> bytes (its kB are KiB)."""
    found = {}
    for line in read_file_bytes(proc_path("meminfo", root=root)).decode().splitlines():
        name, _, value = line.partition(":")
        fields = value.split()
        if fields:
            found[name] = int(fields[0]) * (1024 if len(fields) > 1 else 1)
    return found


def read_swap_pages(*, root: str = PROC_ROOT) -> tuple[int, int] | None:
    """vmstat's pages swapped in and out since boot; None where it lacks them."""
    found: dict[bytes, int] = {}
    for line in read_file_bytes(proc_path("vmstat", root=root)).splitlines():
        if line.startswith((b"pswpin ", b"pswpout ")):
            name, _, value = line.partition(b" ")
            found[name] = int(value)
            if len(found) == 2:
                return found[b"pswpin"], found[b"pswpout"]
    return None


def read_comm(pid: int, *, root: str = PROC_ROOT) -> str | None:
    text = _read_text(pid, "comm", root=root)
    return None if text is None else text.strip()


def read_cmdline(pid: int, *, root: str = PROC_ROOT, limit_bytes: int = 4096) -> str | None:
    """The command line, its arguments joined by spaces, cut at ``limit_bytes``."""
    raw = _read_bytes(pid, "cmdline", root=root, limit=limit_bytes)
    return None if raw is None else raw.rstrip(b"\0").replace(b"\0", b" ").decode(
        errors="replace")


def read_executable(pid: int, *, root: str = PROC_ROOT) -> str | None:
    """Where the executable was, as the process sees it; "" for a process that has none
    (a kernel thread), None without permission."""
    try:
        return os.readlink(proc_path(pid, "exe", root=root))
    except PermissionError:
        return None
    except OSError as error:
        _translate(error, pid, None, root)
        return ""


def owner_uid(pid: int, *, root: str = PROC_ROOT) -> int:
    """The uid that owns the process's /proc entries."""
    try:
        return os.stat(proc_path(pid, root=root)).st_uid
    except OSError:
        raise TargetGone(pid) from None


def parse_maps(text: str) -> list[Mapping]:
    mappings = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 5:
            continue
        start, _, end = fields[0].partition("-")
        mappings.append((int(start, 16), int(end, 16), fields[1], int(fields[2], 16),
                         fields[5] if len(fields) == 6 else ""))
    return mappings


def read_self_statm_rss_bytes(*, root: str = PROC_ROOT) -> int | None:
    """The agent's own resident size."""
    text = _read_text("self", "statm", root=root)
    return None if text is None else int(text.split()[1]) * PAGE_SIZE_BYTES


def mounts_path(*, root: str = PROC_ROOT) -> str:
    """The agent's mount table (where the cgroup filesystems are)."""
    return proc_path("self", "mounts", root=root)


_UNREAD = object()


class ProcessFiles:
    """One target's files for one sampling pass (psutil's ``oneshot()``): each is read
    the first time it is asked for, and the same record is returned after that. Make
    a new one each pass. Rules as for the ``read_*`` functions: a process that has gone
    raises ``TargetGone`` (every time it is asked), a file it may not read is None."""

    def __init__(self, pid: int, *, root: str = PROC_ROOT) -> None:
        self.pid = pid
        self.root = root
        self._read: dict[str, object] = {}

    def _once(self, name: str, read: Callable[[], _T]) -> _T:
        found = self._read.get(name, _UNREAD)
        if found is _UNREAD:
            try:
                found = read()
            except TargetGone as gone:
                found = gone
            self._read[name] = found
        if isinstance(found, TargetGone):
            raise TargetGone(self.pid)
        return found  # type: ignore[return-value]

    def stat(self) -> Stat | None:
        return self._once("stat", lambda: read_stat(self.pid, root=self.root))

    def status(self) -> Status | None:
        return self._once("status", lambda: read_status(self.pid, root=self.root))

    def threads(self) -> tuple[ThreadStat, ...]:
        return self._once("threads", lambda: read_task_stats(self.pid, root=self.root))

    def io(self) -> Io | None:
        return self._once("io", lambda: read_io(self.pid, root=self.root))

    def schedstat(self) -> Schedstat | None:
        return self._once("schedstat", lambda: read_schedstat(self.pid, root=self.root))

    def environ(self) -> dict[str, str] | None:
        return self._once("environ", lambda: read_environ(self.pid, root=self.root))

    def cgroups(self) -> tuple[CgroupEntry, ...] | None:
        return self._once("cgroups", lambda: read_cgroups(self.pid, root=self.root))

    def limits(self) -> dict[str, ResourceLimit] | None:
        return self._once("limits", lambda: read_limits(self.pid, root=self.root))

    def open_fds(self) -> int | None:
        return self._once("open_fds", lambda: count_fds(self.pid, root=self.root))

    def owner_uid(self) -> int:
        return self._once("owner_uid", lambda: owner_uid(self.pid, root=self.root))
