"""Kernel names: CUPTI's name pointers read once each, demangled, and shortened
to a stable name per kernel (``at::native::vectorized_elementwise_kernel``).

Runs in the training process on the probe's thread, once kernel tracing starts.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import re
from collections.abc import Callable

import numpy as np

from dlprof_agent.probe.kernel_records import I64, U64
from dlprof_agent.probe.messages import OTHER

MEMSET_NAME = "[memset]"  # memsets run on the GPU like kernels, as in Nsight's summaries
MAX_SHORT_NAME_CHARS = 160  # a kernel's short name is cut to this
MAX_FULL_NAMES = 20_000  # distinct kernel symbols remembered; more is a pathological job


@functools.cache
def _cxa_demangle() -> tuple[Callable[..., int | None], Callable[[int], None]] | None:
    """libstdc++'s demangler and libc's free, or None where there is none."""
    try:
        libstdcxx = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        libc = ctypes.CDLL(None)
        function = libstdcxx.__cxa_demangle
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_void_p
    function.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.POINTER(ctypes.c_int)]
    free = libc.free
    free.argtypes = [ctypes.c_void_p]
    free.restype = None
    return function, free


@functools.lru_cache(maxsize=4096)
def demangle(symbol: str) -> str:
    """The C++ name of ``symbol`` (``_Z...``), or ``symbol`` itself."""
    if not symbol.startswith("_Z"):
        return symbol
    found = _cxa_demangle()
    if found is None:
        return symbol
    function, free = found
    status = ctypes.c_int(-1)
    pointer = function(symbol.encode(), None, None, ctypes.byref(status))
    if not pointer:
        return symbol
    try:
        text = ctypes.string_at(pointer) if status.value == 0 else b""
    finally:
        free(pointer)
    return text.decode(errors="replace") or symbol


_PLACEHOLDERS = (("(anonymous namespace)", "\x01"), ("operator()", "\x02"),
                 ("operator<<", "\x03"), ("operator<", "\x04"), ("operator>>", "\x05"),
                 ("operator>", "\x06"))
# Wrapper kernels whose first template argument is the real kernel (CUTLASS, CUB).
_WRAPPERS = frozenset({"Kernel", "Kernel2", "device_kernel", "kernel"})
_SIMPLE_ARGUMENT = re.compile(r"[A-Za-z_][\w:]*")


def _strip(text: str) -> tuple[str, str] | None:
    """``text`` without its <...> and (...) groups, and the first template
    argument at depth one; None when the brackets do not balance."""
    kept: list[str] = []
    first: list[str] = []
    depth = 0
    in_first = True
    for char in text:
        if char in "<(":
            depth += 1
            if depth > 1 and in_first and char == "<":
                in_first = False
            continue
        if char in ">)":
            depth -= 1
            if depth < 0:
                return None
            if depth == 0:
                in_first = False
            continue
        if depth == 0:
            kept.append(char)
        elif depth == 1 and in_first:
            if char == ",":
                in_first = False
            else:
                first.append(char)
    return ("".join(kept), "".join(first).strip()) if depth == 0 else None


def normalize_kernel_name(name: str) -> str:
    """A short, stable name for a (demangled) kernel: no return type, template
    arguments or parameters, e.g. ``at::native::vectorized_elementwise_kernel``."""
    text = name.strip()
    for literal, placeholder in _PLACEHOLDERS:
        text = text.replace(literal, placeholder)
    stripped = _strip(text)
    if stripped is None:
        result = text
    else:
        bare, first_argument = stripped
        # What is left of "void ns::kernel": the last word is the name.
        words = bare.split()
        result = words[-1] if words else bare
        last = result.rsplit("::", 1)[-1]
        if last in _WRAPPERS and _SIMPLE_ARGUMENT.fullmatch(first_argument):
            result = f"{result}<{first_argument}>"
    for literal, placeholder in _PLACEHOLDERS:
        result = result.replace(placeholder, literal)
    return result[:MAX_SHORT_NAME_CHARS] or "unnamed"


class _ReadableMemory:
    """This process's readable mappings (from /proc/self/maps), so that a name
    pointer is read only where reading cannot fault, and at most to its mapping's end."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def _load(self) -> None:
        starts, ends = [], []
        with open("/proc/self/maps") as maps:
            for line in maps:
                span, permissions = line.split(maxsplit=2)[:2]
                if permissions.startswith("r"):
                    start, end = span.split("-")
                    starts.append(int(start, 16))
                    ends.append(int(end, 16))
        self._starts, self._ends = starts, ends

    def room(self, pointer: int) -> int:
        """Bytes readable from ``pointer`` on (0: none), looking again once if unknown."""
        for attempt in range(2):
            index = bisect.bisect_right(self._starts, pointer) - 1
            if index >= 0 and pointer < self._ends[index]:
                return self._ends[index] - pointer
            if attempt == 0:
                self._load()
        return 0


_memory = _ReadableMemory()


def _read_c_string(pointer: int) -> bytes:
    room = _memory.room(pointer) if pointer else 0
    if not room:
        raise ValueError("not readable")
    # Mangled names of deeply templated kernels run to many kilobytes.
    return ctypes.string_at(pointer, min(room, 1 << 16)).split(b"\0", 1)[0]


class KernelNames:
    """Kernel name pointers to ids: ``full`` names (demangled) and their short
    ``names``. CUPTI shares one string per kernel, so each pointer is read once."""

    def __init__(self, reader: Callable[[int], bytes] = _read_c_string) -> None:
        self._reader = reader
        self.full: list[str] = [MEMSET_NAME]  # full id 0: memsets
        self.names: list[str] = [MEMSET_NAME]
        self._name_ids: dict[str, int] = {MEMSET_NAME: 0}
        self._full_ids: dict[str, int] = {MEMSET_NAME: 0}
        self.full_to_name: list[int] = [0]
        self._by_pointer: dict[int, int] = {0: 0}

    def forget_pointers(self) -> None:
        """CUPTI was restarted: its strings may have moved."""
        self._by_pointer = {0: 0}

    def _full_id(self, pointer: int) -> int:
        try:
            raw = self._reader(pointer).decode(errors="replace")
        except Exception:
            raw = f"unreadable@{pointer:#x}"
        full = demangle(raw)
        known = self._full_ids.get(full)
        if known is not None:
            return known
        if len(self.full) >= MAX_FULL_NAMES:
            full = OTHER
            known = self._full_ids.get(full)
            if known is not None:
                return known
        short = normalize_kernel_name(full) if full != OTHER else OTHER
        name_id = self._name_ids.setdefault(short, len(self.names))
        if name_id == len(self.names):
            self.names.append(short)
        self._full_ids[full] = len(self.full)
        self.full.append(full)
        self.full_to_name.append(name_id)
        return len(self.full) - 1

    def full_ids(self, pointers: U64) -> I64:
        if not len(pointers):
            return np.zeros(0, dtype=np.int64)
        unique, inverse = np.unique(pointers, return_inverse=True)
        ids = np.empty(len(unique), dtype=np.int64)
        for index, pointer in enumerate(unique.tolist()):
            found = self._by_pointer.get(pointer)
            if found is None:
                found = self._by_pointer[pointer] = self._full_id(pointer)
            ids[index] = found
        return ids[inverse.reshape(-1)]


