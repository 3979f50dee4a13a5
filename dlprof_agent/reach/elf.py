"""Reads the dynamic symbol table (.dynsym) of an ELF file: which functions it
defines, where in the file the ones the injectors call are, and the Python version
constant ``Py_Version``. Nothing but the header, the section headers, .dynsym and its
string table is read, and sizes are checked against the file's, so a damaged or
hostile file gives None, never a huge read."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

_MAX_TABLE_BYTES = 64 << 20  # a real .dynsym/.dynstr is far smaller; refuse garbage sizes
# The functions the injectors call: where each is in the file is kept, to check the
# bytes at the address they would call; and the one whose waits it may interrupt
# (its extent too: a return address inside it says who waits), 3.13's parking lot
# for the same (and PyEvent_WaitTimed, whose call names 3.14's copy of Park); the
# eval loop, whose extent is a busy thread's safe point
# (``safe_point``); and _PyRuntime, whose debug offsets the remote-debugging injector
# reads (3.14+), and which holds 3.13's pending-call mutex, named in the code of
# _PyEval_AddPendingCall (``pending_mutex``).
_CALLED = frozenset({"Py_AddPendingCall", "PyRun_SimpleString", "mmap",
                     "PyThread_acquire_lock_timed", "_PySemaphore_Wait",
                     "_PyParkingLot_Park", "PyEvent_WaitTimed", "_PyEval_EvalFrameDefault",
                     "_PyRuntime", "_PyEval_AddPendingCall"})
_SHT_NOBITS = 8
_ET_DYN = 3
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
class ElfScan:
    """What ``scan_elf_file`` found in one ELF file."""

    defined: frozenset[str]
    py_version: tuple[int, int] | None  # from the Py_Version constant (3.11+)
    shared: bool = True  # ET_DYN (a library or a PIE): addresses are relative to its base
    # name -> (st_value, offset in the file) of defined symbols in sections with contents
    locations: tuple[tuple[str, int, int], ...] = ()
    sizes: tuple[tuple[str, int], ...] = ()  # name -> st_size, of the same symbols

    def location(self, name: str) -> tuple[int, int] | None:
        return next(((value, offset) for symbol, value, offset in self.locations
                     if symbol == name), None)

    def size(self, name: str) -> int | None:
        return next((size for symbol, size in self.sizes if symbol == name), None)


def _read_at(file: BinaryIO, offset: int, size: int, file_size: int) -> bytes | None:
    if offset < 0 or size < 0 or size > _MAX_TABLE_BYTES or offset + size > file_size:
        return None
    file.seek(offset)
    data = file.read(size)
    return data if len(data) == size else None


def _scan_elf(file: BinaryIO) -> ElfScan | None:
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

    called = [(name, shndx, value, size) for name, (shndx, value, size) in defined.items()
              if name in _CALLED and shndx < min(len(sections), _SHN_LORESERVE)
              and sections[shndx].type != _SHT_NOBITS]
    locations = tuple((name, value, sections[shndx].offset + value - sections[shndx].addr)
                      for name, shndx, value, _size in called)
    return ElfScan(frozenset(defined),
                    _py_version(file, file_size, sections, defined.get("Py_Version"), order),
                    shared=e_type == _ET_DYN, locations=locations,
                    sizes=tuple((name, size) for name, _shndx, _value, size in called))


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


def scan_elf_file(path: str) -> ElfScan | None:
    """Scan ``path``; None if it does not exist or is not ELF. PermissionError propagates."""
    try:
        with open(path, "rb") as file:
            return _scan_elf(file)
    except PermissionError:
        raise
    except (OSError, struct.error):
        return None

