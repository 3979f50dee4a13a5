"""Which gdb can put a thread of this CPU back whole. gdb before 14.1 keeps the XSAVE
area in a fixed buffer (2696 bytes from 8.0: AVX-512 and PKRU) while the kernel takes
the area back only whole (``xstateregs_set``), so on a CPU with a larger one (AMX's is
11008 bytes) each write of a vector register fails, and gdb's putting a thread back
after a call stops halfway, before orig_rax (``gdb``)."""

from __future__ import annotations

import functools
import re
import subprocess

from dlprof_agent.reach.frame import component_names
from dlprof_agent.reach.xsave_layout import XsaveLayout

VERSION_SECONDS = 30.0  # `gdb --version` answers at once; this only bounds a stuck one
# gdb from 14.1 sizes the XSAVE area from CPUID; before, a fixed buffer of this many
# bytes (2696 since 8.0, with PKRU; before 8.0 at most AVX's 832, taken here as such)
XSAVE_SIZED_GDB = (14, 1)
_FIXED_XSAVE_BYTES = ((8, 0), 2696), ((0, 0), 832)


@functools.cache
def gdb_version(gdb: str) -> tuple[int, int] | None:
    """The major and minor version of the gdb at ``gdb``, from ``gdb --version``; None
    where it does not say."""
    try:
        first = subprocess.run([gdb, "--version"], capture_output=True, text=True,
                               timeout=VERSION_SECONDS, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_gdb_version(first)


def parse_gdb_version(text: str) -> tuple[int, int] | None:
    """``GNU gdb (Debian 13.1-3) 13.1`` -> (13, 1): the first number after the
    vendor's parentheses on the first line."""
    line = text.splitlines()[0] if text else ""
    found = re.search(r"(\d+)\.(\d+)", line.rpartition(")")[2]) or re.search(
        r"(\d+)\.(\d+)", line)
    return (int(found[1]), int(found[2])) if found else None


def xstate_refusal(version: tuple[int, int] | None, layout: XsaveLayout | None) -> str | None:
    """Why gdb ``version`` cannot put back the whole register state of a thread on a CPU
    with XSAVE ``layout``, in words; None where it can or where either is unknown (the
    script checks again before its calls)."""
    if version is None or layout is None or version >= XSAVE_SIZED_GDB:
        return None
    limit = next(size for since, size in _FIXED_XSAVE_BYTES if version >= since)
    needed = layout.size(layout.xcr0)
    if needed <= limit:
        return None
    beyond = sum(1 << index for index, part in layout.components.items()
                 if layout.xcr0 >> index & 1 and part.offset + part.size > limit)
    return (f"gdb {version[0]}.{version[1]} cannot restore the {component_names(beyond)} "
            f"registers of this CPU (XSAVE area {needed} bytes, gdb writes {limit})")
