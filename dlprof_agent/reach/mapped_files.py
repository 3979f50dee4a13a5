"""Where the agent opens a file that a job has mapped (its libc, its libpython), so
that what it reads is the job's own file and not a namesake of the agent's, where
a function of such a file is in the job, and where a free range of its address space is.

/proc/<pid>/maps names each file from the reader's root where the file can be reached
from it, and from the job's mount namespace otherwise. For a job in a container (its
own mount namespace) the path is the job's view, and /proc/<pid>/root leads to it. For
a job in a chroot of the agent's namespace the path is the agent's view: it starts with
the chroot's directory, which is stripped before going through /proc/<pid>/root (the
path as it is would name the agent's own libc, whose addresses called in the job kill
it). /proc/<pid>/map_files comes last: it opens the mapped file itself, even when
deleted since, but only with CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE.

Callers still check the bytes they rely on against the job's memory."""

from __future__ import annotations

import itertools
import mmap
import os

from dlprof_agent.collectors.target import Target
from dlprof_agent.reach.elf import ElfScan, scan_elf_file
from dlprof_agent.reach.procfs import (
    Mapping,
    inside_root_path,
    mapped_file_path,
    open_memory,
    read_root,
)

_DELETED = " (deleted)"
# Above every user address (x86-64: 2**47, or 2**56 with 5-level page tables; arm64: up
# to 2**52) and below x86-64's [vsyscall] page
_USER_SPACE_END = 1 << 56
_CHECKED_BYTES = 16  # of a function's code, compared between its file and the job


def job_view(path: str, job_root: str | None) -> str:
    """``path``, as /proc/<pid>/maps shows it to the agent, as the job sees it: the job's
    root directory, as the agent sees it, taken off the front."""
    if job_root is None or job_root == "/" or not job_root.startswith("/"):
        return path
    prefix = job_root.rstrip("/")
    return path[len(prefix):] if path.startswith(prefix + "/") else path


def mapped_file_paths(target: Target, path: str, maps: list[Mapping]) -> list[str]:
    """Paths through which the agent may open the file ``path`` mapped in the target (as
    its memory map names it), the likeliest first; each to be tried in turn."""
    pid, procfs = target.pid, target.procfs
    clean = path.removesuffix(_DELETED)
    paths = [inside_root_path(pid, job_view(clean, read_root(pid, procfs=procfs)),
                              procfs=procfs)]
    start = next(((start, end) for start, end, _, offset, mapped in maps
                  if mapped == path and offset == 0), None)
    if start is not None:
        paths.append(mapped_file_path(pid, *start, procfs=procfs))
    return list(dict.fromkeys(paths))


def libc_path(maps: list[Mapping]) -> str | None:
    """The C library's path in a memory map (glibc's or musl's)."""
    for *_, path in maps:
        name = os.path.basename(path)
        if name.startswith(("libc.so", "libc-2.", "ld-musl-")):
            return path
    return None


def first_readable_elf(files: list[str]) -> tuple[str, ElfScan] | None:
    """The first of ``files`` (one file's paths, best first) that the agent may read
    and is ELF, scanned."""
    for file in files:
        try:
            scan = scan_elf_file(file)
        except PermissionError:
            continue
        if scan is not None:
            return file, scan
    return None


def function_address(target: Target, maps: list[Mapping], path: str, files: list[str],
                     name: str) -> int | None:
    """Where ``name``, defined in the file mapped as ``path`` and opened through the first
    of ``files`` that can be read, is in the target; None unless the bytes there are
    the file's own (a wrong address is never called)."""
    return _symbol_address(target, maps, path, files, name, checked=True)


def data_address(target: Target, maps: list[Mapping], path: str, files: list[str],
                 name: str) -> int | None:
    """Where the data symbol ``name`` of the file mapped as ``path`` is in the target:
    as ``function_address``, less the check of its bytes, which the job changes."""
    return _symbol_address(target, maps, path, files, name, checked=False)


def _symbol_address(target: Target, maps: list[Mapping], path: str, files: list[str],
                    name: str, *, checked: bool) -> int | None:
    readable = first_readable_elf(files)
    if readable is None:
        return None
    file, scan = readable
    location = scan.location(name)
    if location is None:
        return None
    value, offset = location
    base = 0
    if scan.shared:
        starts = [start for start, _, _, map_offset, mapped in maps
                  if mapped == path and map_offset == 0]
        if not starts:
            return None
        base = min(starts)
    if not checked:
        return base + value
    try:
        with open(file, "rb") as source:
            source.seek(offset)
            expected = source.read(_CHECKED_BYTES)
        found = read_memory(target, base + value, _CHECKED_BYTES)
    except OSError:
        return None
    return base + value if len(expected) == _CHECKED_BYTES and found == expected else None


def read_memory(target: Target, address: int, size: int) -> bytes:
    with open_memory(target.pid, procfs=target.procfs) as memory:
        memory.seek(address)
        return memory.read(size)


def free_address(maps: list[Mapping], size: int) -> int | None:
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
