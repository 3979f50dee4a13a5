"""Where 3.13's pending-call mutex is, so that a busy main thread may be borrowed there.

On 3.13 ``Py_AddPendingCall`` takes a PyMutex, ``_PyRuntime.ceval.pending_mainthread``'s.
Free, that is one compare-and-swap and no system call. Contended, the caller spins and
then parks with ``_PY_LOCK_DETACH``, releasing its GIL: for a main thread stopped in the
middle of a bytecode, another thread could then run into its half-done instruction. So
the ptrace injector borrows a busy 3.13 main thread only with every other thread of the
job stopped and this mutex free: no thread holds it then, and none can take it before the
borrowed thread has queued its call and left (``ptrace``).

The address is _PyRuntime plus the offset of that field in 3.13's ``_PyRuntimeState``
(a struct of the interpreter's internals), and is used only where the code of
``_PyEval_AddPendingCall`` in the job names it: on x86-64 as an absolute 32-bit address
(a build that is not position-independent, as Debian's) or %rip-relative; on arm64 by
``adrp`` and ``add`` (``arm64``), as Debian's arm64 build does (the field's offset is
the same there). A build laid out otherwise borrows no busy thread, as before."""

from __future__ import annotations

import struct
from collections.abc import Callable

# offsetof(_PyRuntimeState, ceval.pending_mainthread) in 3.13, default (GIL) build
PENDING_MAINTHREAD_OFFSET_3_13 = 0xA50
# offsetof(struct _pending_calls, mutex): after the PyThreadState *handling_thread
MUTEX_OFFSET = 8


def code_names_address(code: bytes, code_address: int, target: int) -> bool:
    """``code``, loaded at ``code_address``, holds an instruction that puts ``target``
    in a register: ``mov $imm32, r32`` (zero-extended), or ``lea``/``mov`` with a
    %rip-relative operand."""
    for at in range(len(code) - 4):
        byte = code[at]
        if 0xB8 <= byte <= 0xBF and struct.unpack_from("<I", code, at + 1)[0] == target:
            return True
        # REX.W (0x48-0x4f), then lea (0x8d); ModRM with mod 00, r/m 101: disp32(%rip)
        if (at + 7 <= len(code) and 0x48 <= byte <= 0x4F and code[at + 1] == 0x8D
                and code[at + 2] & 0xC7 == 0x05):
            displacement = struct.unpack_from("<i", code, at + 3)[0]
            if code_address + at + 7 + displacement == target:
                return True
    return False


def pending_mutex_address(runtime_state: int, add_pending_call_code: bytes,
                          code_address: int,
                          names: Callable[[bytes, int, int], bool] = code_names_address
                          ) -> int | None:
    """The address of 3.13's main-thread pending-call mutex, given where _PyRuntime is and
    the code of _PyEval_AddPendingCall; None unless that code names its queue, as
    ``names`` (its CPU's reading, ``cpu``) finds it."""
    queue = runtime_state + PENDING_MAINTHREAD_OFFSET_3_13
    if not names(add_pending_call_code, code_address, queue):
        return None
    return queue + MUTEX_OFFSET
