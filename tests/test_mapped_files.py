"""Where the agent opens a file a job has mapped: through the job's root, its chroot's
directory taken off a path the memory map gives in the agent's view (on a fake procfs
tree), and the function addresses checked against the job's memory (this process)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from dlprof_agent.collectors.target import Target
from dlprof_agent.reach.mapped_files import (
    free_address,
    function_address,
    job_view,
    libc_path,
    mapped_file_paths,
)
from dlprof_agent.reach.procfs import memory_map

LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"


def _fake_procfs(tmp_path: Path, pid: int, root: str) -> str:
    procfs = tmp_path / "proc"
    (procfs / str(pid)).mkdir(parents=True)
    (procfs / str(pid) / "root").symlink_to(root)
    return str(procfs)


def test_a_path_inside_a_chroot_is_taken_as_the_job_sees_it() -> None:
    assert job_view("/srv/roots/trixie" + LIBC, "/srv/roots/trixie") == LIBC
    assert job_view("/srv/roots/trixie" + LIBC, "/srv/roots/trixie/") == LIBC
    # Its own namespace's root ("/"), or a path outside the chroot: left as it is.
    assert job_view(LIBC, "/") == LIBC
    assert job_view("/srv/other" + LIBC, "/srv/roots/trixie") == "/srv/other" + LIBC
    assert job_view("/srv/roots/trixie-old" + LIBC, "/srv/roots/trixie") == (
        "/srv/roots/trixie-old" + LIBC)
    assert job_view(LIBC, None) == LIBC


def test_a_chroot_jobs_libc_is_opened_inside_its_root(tmp_path: Path) -> None:
    chroot = tmp_path / "roots" / "trixie"
    chroot.mkdir(parents=True)
    procfs = _fake_procfs(tmp_path, 4321, str(chroot))
    seen = str(chroot) + LIBC  # as /proc/<pid>/maps shows it to a reader outside
    maps = [(0x7F0000000000, 0x7F0000028000, "r--p", 0, seen),
            (0x7F0000028000, 0x7F000018B000, "r-xp", 0x28000, seen)]
    assert mapped_file_paths(Target(4321, 0, procfs), seen, maps) == [
        f"{procfs}/4321/root{LIBC}", f"{procfs}/4321/map_files/7f0000000000-7f0000028000"]


def test_a_container_jobs_libc_is_opened_through_its_root(tmp_path: Path) -> None:
    procfs = _fake_procfs(tmp_path, 4321, "/")  # another mount namespace reads as "/"
    maps = [(0x7F0000000000, 0x7F0000028000, "r--p", 0, LIBC + " (deleted)")]
    assert mapped_file_paths(Target(4321, 0, procfs), LIBC + " (deleted)", maps) == [
        f"{procfs}/4321/root{LIBC}", f"{procfs}/4321/map_files/7f0000000000-7f0000028000"]


def test_a_function_is_found_where_its_bytes_are_the_files() -> None:
    target = Target.of(os.getpid())
    maps = memory_map(target.pid)
    libc = libc_path(maps)
    assert libc is not None
    address = function_address(target, maps, libc, mapped_file_paths(target, libc, maps), "mmap")
    assert address == ctypes.cast(ctypes.CDLL(None).mmap, ctypes.c_void_p).value
    # No file to read: no address.
    assert function_address(target, maps, libc, ["/nonexistent" + libc], "mmap") is None


def test_a_free_range_is_found_where_the_cpu_puts_user_mappings() -> None:
    """x86-64's mappings sit below 2**47, with [vsyscall] far above; arm64's (48-bit
    addresses) near 2**48: on both the page goes in the widest gap between them."""
    page = 4096
    x86_64 = [(0x555555554000, 0x555555556000, "r-xp", 0, "/usr/bin/python3"),
              (0x7F0000000000, 0x7F0000100000, "r-xp", 0, "/usr/lib/libc.so.6"),
              (0x7FFFF0000000, 0x7FFFF0021000, "rw-p", 0, "[stack]"),
              (0xFFFFFFFFFF600000, 0xFFFFFFFFFF601000, "--xp", 0, "[vsyscall]")]
    arm64 = [(0xAAAAAAAA0000, 0xAAAAAAAB0000, "r-xp", 0, "/usr/bin/python3.11"),
             (0xFFFF80000000, 0xFFFF80100000, "r-xp", 0, "/usr/lib/aarch64-linux-gnu/libc.so.6"),
             (0xFFFFF7FF0000, 0xFFFFF8000000, "r-xp", 0, "[vdso]"),
             (0xFFFFFFFDF000, 0xFFFFFFFFF000, "rw-p", 0, "[stack]")]
    for maps in (x86_64, arm64):
        at = free_address(maps, page)
        assert at is not None and at % page == 0
        # in the widest gap, clear of every mapping
        assert maps[0][1] < at < maps[1][0]
