"""Whether a job's interpreter can still take a call. A job at its exit runs
``Py_FinalizeEx`` and then the C++ and libc exit handlers (libtorch's destructors
among them) for up to seconds; a thread borrowed then and made to call
``Py_AddPendingCall`` finds no interpreter (``_PyRuntime.interpreters.main`` is
NULL once it is deleted) and the job dies with SIGSEGV instead of exiting 0. So
before each borrow, with the thread to borrow stopped, the injectors read two words
of ``_PyRuntime``:

- ``initialized``, which ``Py_FinalizeEx`` clears first (and which is 0 before
  ``Py_Initialize`` is done);
- ``_finalizing``, which it sets and never clears ("Only reset to NULL if
  Py_Initialize() is called again", Include/internal/pycore_runtime.h).

Their offsets are those of ``struct pyruntimestate`` in 3.10 (``preinitializing``,
``preinitialized``, ``core_initialized``, ``initialized``, then ``_finalizing``),
and in 3.11 and 3.12 (an ``_initialized`` int first). From 3.13 the struct opens
with ``_Py_DebugOffsets`` and its ``runtime_state`` section gives ``_finalizing``
and ``interpreters.head``: the head is NULL once the last interpreter is deleted."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import NamedTuple

from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import InjectionNotNow
from dlprof_agent.reach.debug_offsets import COOKIE

Read = Callable[[int, int], bytes]

# Offsets in _PyRuntime of ``int initialized`` and ``_finalizing`` (a pointer)
_BEFORE_DEBUG_OFFSETS = {(3, 10): (12, 16), (3, 11): (16, 24), (3, 12): (16, 24)}
# _Py_DebugOffsets (3.13, 3.14): cookie, version, free_threaded, then runtime_state's
# size, finalizing and interpreters_head, each a uint64_t
_RUNTIME_STATE_AT = 24
_HEADER_BYTES = _RUNTIME_STATE_AT + 3 * 8


class LifeWords(NamedTuple):
    """Addresses, in the job, of the words that say its interpreter is alive."""

    finalizing: int  # _PyRuntime._finalizing: NULL while the interpreter runs
    initialized: int | None = None  # _PyRuntime.initialized: 1 while it runs
    interpreters: int | None = None  # _PyRuntime.interpreters.head: not NULL while one is


def life_words(version: tuple[int, int] | None, runtime_state: int, read: Read
               ) -> LifeWords | None:
    """Where ``read``'s process keeps the words, given the address of its
    ``_PyRuntime``; None where this version's layout is not known here."""
    if version in _BEFORE_DEBUG_OFFSETS:
        initialized, finalizing = _BEFORE_DEBUG_OFFSETS[version]
        return LifeWords(runtime_state + finalizing, runtime_state + initialized)
    try:
        header = read(runtime_state, _HEADER_BYTES)
    except OSError:
        return None
    if len(header) < _HEADER_BYTES or header[:8] != COOKIE:
        return None
    size, finalizing, head = struct.unpack_from("<QQQ", header, _RUNTIME_STATE_AT)
    if not _HEADER_BYTES <= finalizing < size or not _HEADER_BYTES <= head < size:
        return None  # not the layout read here
    return LifeWords(runtime_state + finalizing, interpreters=runtime_state + head)


def shutting_down(words: LifeWords, read: Read) -> bool:
    """The interpreter is not (or no longer) running, as the words say now. Raises
    OSError where they cannot be read."""
    def word(address: int, size: int) -> int:
        data = read(address, size)
        if len(data) != size:
            raise OSError(f"short read at {address:#x}")
        value: int = int.from_bytes(data, "little")
        return value

    return bool(word(words.finalizing, 8)
                or (words.initialized is not None and word(words.initialized, 4) != 1)
                or (words.interpreters is not None and not word(words.interpreters, 8)))


def exiting(target: Target) -> InjectionNotNow:
    return InjectionNotNow(
        f"process {target.pid} is shutting its Python interpreter down; nothing was done to it",
        "a job at its exit takes no probe: the agent reads it from outside until it ends",
        pid=target.pid)
