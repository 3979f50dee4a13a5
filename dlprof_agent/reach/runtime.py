"""Which ELF file of a process exports the CPython C API the injectors call: its
executable (a static build) or a mapped ``libpython3*.so*``, and which Python version
that is. A process where none defines the functions is left untouched: not Python,
or a Python that does not export them."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from dlprof_agent.reach.elf import ElfScan, scan_elf_file
from dlprof_agent.reach.procfs import raise_if_gone
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



def _libpython_mappings(maps: str) -> dict[str, str]:
    """Mapped libpython3*.so* files: path as the target sees it -> one address range."""
    found: dict[str, str] = {}
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and _LIBPYTHON.match(os.path.basename(fields[5].split(" (")[0])):
            found.setdefault(fields[5], fields[0])
    return found


def _scan_mapped(pid: int, procfs: str, path: str, addresses: str) -> ElfScan | None:
    # Through the target's root first (its mount namespace); then map_files, which
    # still opens a library deleted or replaced since it was loaded.
    start, _, end = addresses.partition("-")
    candidates = [f"{procfs}/{pid}/root{path.removesuffix(' (deleted)')}",
                  f"{procfs}/{pid}/map_files/{int(start, 16):x}-{int(end, 16):x}"]
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
        exe_scan = scan_elf_file(f"{base}/exe")
    except PermissionError:
        raise refused(pid, procfs, "cannot read its executable") from None
    except OSError:  # a kernel thread has no executable, an exited process no /proc entry
        raise_if_gone(pid, procfs)
        return None
    exe_version = _version_from_name(exe_path.removesuffix(" (deleted)"))
    if exe_scan is not None and exe_scan.defined >= REQUIRED_SYMBOLS:
        return PythonRuntime(exe_path, exe_scan.py_version or exe_version)

    try:
        with open(f"{base}/maps", encoding="utf-8", errors="replace") as file:
            maps = file.read()
    except PermissionError:
        raise refused(pid, procfs, "cannot read its memory map") from None
    except OSError:
        raise_if_gone(pid, procfs)
        return None
    for path, addresses in _libpython_mappings(maps).items():
        try:
            scan = _scan_mapped(pid, procfs, path, addresses)
        except PermissionError:
            raise refused(pid, procfs, f"cannot read {path}") from None
        if scan is not None and scan.defined >= REQUIRED_SYMBOLS:
            clean = path.removesuffix(" (deleted)")
            return PythonRuntime(clean, scan.py_version or _version_from_name(clean) or exe_version)
    return None

