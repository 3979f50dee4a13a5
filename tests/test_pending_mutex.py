"""3.13's pending-call mutex is used only where _PyEval_AddPendingCall's code names its
queue at _PyRuntime plus the offset read from 3.13's layout (``reach/pending_mutex.py``).
Its start, as Debian trixie's python3.13 (not position-independent) has it, then the
same as a position-independent build would load it."""

from __future__ import annotations

import struct

from dlprof_agent.reach.pending_mutex import (
    MUTEX_OFFSET,
    PENDING_MAINTHREAD_OFFSET_3_13,
    code_names_address,
    pending_mutex_address,
)

RUNTIME = 0xA3F400  # _PyRuntime in trixie's python3.13
QUEUE = RUNTIME + PENDING_MAINTHREAD_OFFSET_3_13
CODE_AT = 0x681680  # _PyEval_AddPendingCall there
# endbr64; push %r14; mov %ecx,%r14d; push %r13; mov %rdx,%r13; push %r12;
# mov %rdi,%r12; push %rbp; push %rbx; mov $0xa3fe50,%ebx
TRIXIE = bytes.fromhex("f30f1efa 4156 4189ce 4155 4989d5 4154 4989fc 55 53 bb50fea300")


def pie_code(at: int, target: int) -> bytes:
    """endbr64; lea target(%rip),%rbx (7 bytes, 4 in): as a PIE build loads the queue."""
    return bytes.fromhex("f30f1efa 488d1d") + struct.pack("<i", target - (at + 4 + 7))


def test_trixies_code_names_its_queue_and_the_mutex_follows_the_thread_pointer() -> None:
    assert code_names_address(TRIXIE, CODE_AT, QUEUE)
    assert pending_mutex_address(RUNTIME, TRIXIE, CODE_AT) == 0xA3FE50 + MUTEX_OFFSET == 0xA3FE58


def test_a_rip_relative_load_names_it_where_it_points() -> None:
    at = 0x7F00_1234_5000
    queue = 0x7F00_1250_0000 + PENDING_MAINTHREAD_OFFSET_3_13
    assert code_names_address(pie_code(at, queue), at, queue)
    assert pending_mutex_address(queue - PENDING_MAINTHREAD_OFFSET_3_13, pie_code(at, queue),
                                 at) == queue + MUTEX_OFFSET
    # The same bytes loaded elsewhere point elsewhere
    assert not code_names_address(pie_code(at, queue), at + 0x1000, queue)


def test_a_build_laid_out_otherwise_gets_no_mutex() -> None:
    # _PyRuntime one page off: the code names another address than the layout says
    assert pending_mutex_address(RUNTIME + 0x1000, TRIXIE, CODE_AT) is None
    # Neither form: the queue's address only as data, after a non-mov opcode
    assert pending_mutex_address(RUNTIME, b"\x90\x90" + struct.pack("<I", QUEUE), CODE_AT) is None
    assert pending_mutex_address(RUNTIME, b"", CODE_AT) is None
