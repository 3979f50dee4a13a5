"""The ``_Py_DebugOffsets`` table that CPython keeps at the start of ``_PyRuntime``
(PEP 768): where, in a running interpreter, a remote debugger finds the main thread
state and the fields through which it asks that thread to run a script.

The table is a C struct of ``uint64_t`` fields only, behind an 8-byte cookie
``xdebugpy``. Its own layout changes between minor versions (fields are added in the
middle), and CPython keeps it stable across the patch releases of one minor version
only, never across pre-releases. So only the layouts written down here are read: for
3.14, from Include/internal/pycore_debug_offsets.h of the 3.14 release (struct
``_Py_DebugOffsets``, 95 words), and a table of any other version, or of a 3.14
alpha/beta/rc, is refused: the caller uses another injector.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from dlprof_agent.errors import UnknownDebugOffsets

COOKIE = b"xdebugpy"
# pycore_ceval.h (3.14): the eval-breaker bit that makes a thread handle "pending" work,
# the remote debugger's script among it, at its next check.
EVAL_PLEASE_STOP_BIT = 1 << 5

# Sections of struct _Py_DebugOffsets in 3.14, in order, each a run of uint64_t fields
# (pycore_debug_offsets.h). Only the names used here matter; the counts place them.
_LAYOUT_3_14: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("header", ("cookie", "version", "free_threaded")),
    ("runtime_state", ("size", "finalizing", "interpreters_head")),
    ("interpreter_state", ("size", "id", "next", "threads_head", "threads_main", "gc",
                           "imports_modules", "sysdict", "builtins", "ceval_gil",
                           "gil_runtime_state", "gil_runtime_state_enabled",
                           "gil_runtime_state_locked", "gil_runtime_state_holder",
                           "code_object_generation", "tlbc_generation")),
    ("thread_state", ("size", "prev", "next", "interp", "current_frame", "thread_id",
                      "native_thread_id", "datastack_chunk", "status")),
    ("interpreter_frame", ("size", "previous", "executable", "instr_ptr", "localsplus",
                           "owner", "stackpointer", "tlbc_index")),
    ("code_object", ("size", "filename", "name", "qualname", "linetable", "firstlineno",
                     "argcount", "localsplusnames", "localspluskinds", "co_code_adaptive",
                     "co_tlbc")),
    ("pyobject", ("size", "ob_type")),
    ("type_object", ("size", "tp_name", "tp_repr", "tp_flags")),
    ("tuple_object", ("size", "ob_item", "ob_size")),
    ("list_object", ("size", "ob_item", "ob_size")),
    ("set_object", ("size", "used", "table", "mask")),
    ("dict_object", ("size", "ma_keys", "ma_values")),
    ("float_object", ("size", "ob_fval")),
    ("long_object", ("size", "lv_tag", "ob_digit")),
    ("bytes_object", ("size", "ob_size", "ob_sval")),
    ("unicode_object", ("size", "state", "length", "asciiobject_size")),
    ("gc", ("size", "collecting")),
    ("gen_object", ("size", "gi_name", "gi_iframe", "gi_frame_state")),
    ("llist_node", ("next", "prev")),
    ("debugger_support", ("eval_breaker", "remote_debugger_support",
                          "remote_debugging_enabled", "debugger_pending_call",
                          "debugger_script_path", "debugger_script_path_size")),
)


def field_offsets(layout: tuple[tuple[str, tuple[str, ...]], ...]
                  ) -> dict[str, int]:
    """"section.field" -> its byte offset in the table."""
    offsets: dict[str, int] = {}
    word = 0
    for section, fields in layout:
        for name in fields:
            offsets[f"{section}.{name}"] = word * 8
            word += 1
    return offsets


LAYOUTS = {(3, 14): _LAYOUT_3_14}
TABLE_BYTES = {version: 8 * sum(len(fields) for _, fields in layout)
               for version, layout in LAYOUTS.items()}
READ_BYTES = max(TABLE_BYTES.values())  # what to read from _PyRuntime before parsing


@dataclass(frozen=True)
class DebugOffsets:
    """What a remote exec needs, all offsets in bytes. Names follow the header."""

    version_hex: int  # PY_VERSION_HEX of the target
    free_threaded: bool
    interpreters_head: int  # in _PyRuntimeState: the first PyInterpreterState *
    threads_main: int  # in PyInterpreterState: the main PyThreadState *
    native_thread_id: int  # in PyThreadState
    remote_debugging_enabled: int  # in PyInterpreterState: config.remote_debug (an int)
    eval_breaker: int  # in PyThreadState: a uintptr_t of bits
    remote_debugger_support: int  # in PyThreadState: _PyRemoteDebuggerSupport
    debugger_pending_call: int  # in _PyRemoteDebuggerSupport: an int32
    debugger_script_path: int  # in _PyRemoteDebuggerSupport: char[size]
    debugger_script_path_size: int  # bytes, the final NUL included

    @property
    def version(self) -> tuple[int, int]:
        return self.version_hex >> 24 & 0xFF, self.version_hex >> 16 & 0xFF


def is_final_release(version_hex: int) -> bool:
    # PY_VERSION_HEX's release level nibble: 0xF for a final release
    return version_hex & 0xF0 == 0xF0


def parse_debug_offsets(raw: bytes) -> DebugOffsets:
    """The table at the start of a target's ``_PyRuntime`` (little-endian, as read from
    its memory). Raises UnknownDebugOffsets for anything but a known final-release
    layout: no cookie (a Python before 3.13, or not _PyRuntime), another minor version,
    a pre-release, or too few bytes."""
    if len(raw) < 24 or raw[:8] != COOKIE:
        raise UnknownDebugOffsets("no debug offsets (cookie) at _PyRuntime")
    version_hex, free_threaded = struct.unpack_from("<QQ", raw, 8)
    version = (version_hex >> 24 & 0xFF, version_hex >> 16 & 0xFF)
    layout = LAYOUTS.get(version)
    if layout is None:
        raise UnknownDebugOffsets("debug offsets of python {}.{}, whose layout is not "
                                  "known here".format(*version))
    if not is_final_release(version_hex):
        raise UnknownDebugOffsets(f"debug offsets of a pre-release ({version_hex:#x}), "
                                  "whose layout may differ from the release's")
    if len(raw) < TABLE_BYTES[version]:
        raise UnknownDebugOffsets("debug offsets cut short")
    at = field_offsets(layout)

    def field(name: str) -> int:
        value: int = struct.unpack_from("<Q", raw, at[name])[0]
        return value

    return DebugOffsets(
        version_hex=version_hex, free_threaded=bool(free_threaded),
        interpreters_head=field("runtime_state.interpreters_head"),
        threads_main=field("interpreter_state.threads_main"),
        native_thread_id=field("thread_state.native_thread_id"),
        remote_debugging_enabled=field("debugger_support.remote_debugging_enabled"),
        eval_breaker=field("debugger_support.eval_breaker"),
        remote_debugger_support=field("debugger_support.remote_debugger_support"),
        debugger_pending_call=field("debugger_support.debugger_pending_call"),
        debugger_script_path=field("debugger_support.debugger_script_path"),
        debugger_script_path_size=field("debugger_support.debugger_script_path_size"))
