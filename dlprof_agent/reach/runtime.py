"""Which ELF file of a process exports the CPython C API the injectors call: its
executable (a static build) or a mapped ``libpython3*.so*``, and which Python version
that is. A process where none defines the functions is left untouched: not Python,
or a Python that does not export them."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import TargetGone
from dlprof_agent.reach.elf import ElfScan, scan_elf_file
from dlprof_agent.reach.mapped_files import mapped_file_paths
from dlprof_agent.reach.procfs import (
    Mapping,
    executable,
    executable_path,
    raise_if_gone,
    read_memory_map,
)
from dlprof_agent.reach.refusal import refused

# What the injectors call in the job (besides libc's mmap); both must be defined in the
# target (readelf --dyn-syms).
REQUIRED_SYMBOLS = frozenset({"Py_AddPendingCall", "PyRun_SimpleString"})
MIN_TARGET_VERSION = (3, 10)  # the probe's own floor

_LIBPYTHON = re.compile(r"libpython3(?:\.(\d+))?[a-z]*\.so(?:\.|$)")
_PYTHON_EXE = re.compile(r"python(\d)\.(\d+)[a-z]*")


@dataclass(frozen=True)
class PythonRuntime:
    library: str  # path, as the target sees it, of the ELF file exporting the C API
    version: tuple[int, int] | None  # (3, 11) when known, else None


def _version_from_name(path: str) -> tuple[int, int] | None:
    name = os.path.basename(path)
    library = _LIBPYTHON.match(name)
    if library is not None:
        return (3, int(library.group(1))) if library.group(1) else None
    exe = _PYTHON_EXE.fullmatch(name)
    return (int(exe.group(1)), int(exe.group(2))) if exe else None



def _libpython_mappings(maps: list[Mapping]) -> dict[str, tuple[int, int]]:
    """Mapped libpython3*.so* files: path as the target sees it -> one address range."""
    found: dict[str, tuple[int, int]] = {}
    for start, end, _, _, path in maps:
        if path and _LIBPYTHON.match(os.path.basename(path.split(" (")[0])):
            found.setdefault(path, (start, end))
    return found


def _scan_mapped(target: Target, path: str, addresses: tuple[int, int]) -> ElfScan | None:
    # Through the target's root first (its mount namespace, its chroot); then
    # map_files, which still opens a library deleted or replaced since it was loaded.
    candidates = mapped_file_paths(target, path, [(*addresses, "", 0, path)])
    denied: PermissionError | None = None
    for candidate in candidates:
        try:
            scan = scan_elf_file(candidate)
        except PermissionError as error:
            denied = error
            continue
        if scan is not None:
            return scan
    if denied is not None:
        raise denied
    return None


def find_python_runtime(target: Target) -> PythonRuntime | None:
    """The ELF file through which the target exports the CPython C API.

    None when the process is not a CPython we can inject into: neither its executable
    nor a mapped ``libpython3*.so*`` defines all of REQUIRED_SYMBOLS (PyGILState_Ensure,
    PyRun_SimpleString, ...): a kernel thread, a shell, a Python that does not export them.
    ``library`` is the path as the target sees it (it may be in another mount namespace).
    Raises TargetNotFound when there is no such (live) process, and InjectionRefused
    when the process exists but the agent may not read its executable or mappings.
    """
    pid, procfs = target.pid, target.procfs
    try:
        exe_path = executable(pid, procfs=procfs)
        if exe_path is None:
            raise PermissionError(pid)
        if not exe_path:  # a kernel thread has no executable
            return None
        # Opening the link itself reaches the file even across mount namespaces.
        exe_scan = scan_elf_file(executable_path(pid, procfs=procfs))
    except PermissionError:
        raise refused(target, "cannot read its executable") from None
    except (OSError, TargetGone):  # an exited process has no /proc entry
        raise_if_gone(pid, procfs=procfs)
        return None
    exe_version = _version_from_name(exe_path.removesuffix(" (deleted)"))
    if exe_scan is not None and exe_scan.defined >= REQUIRED_SYMBOLS:
        return PythonRuntime(exe_path, exe_scan.py_version or exe_version)

    try:
        maps = read_memory_map(pid, procfs=procfs)
    except TargetGone:
        raise_if_gone(pid, procfs=procfs)
        return None
    if maps is None:
        raise refused(target, "cannot read its memory map")
    for path, addresses in _libpython_mappings(maps).items():
        try:
            scan = _scan_mapped(target, path, addresses)
        except PermissionError:
            raise refused(target, f"cannot read {path}") from None
        if scan is not None and scan.defined >= REQUIRED_SYMBOLS:
            clean = path.removesuffix(" (deleted)")
            return PythonRuntime(clean, scan.py_version or _version_from_name(clean) or exe_version)
    return None

