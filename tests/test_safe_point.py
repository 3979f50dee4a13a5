"""Where a busy main thread may be stopped to queue the probe (``reach/safe_point.py``):
PCs in other libraries only, and never inside a signal handler."""

from __future__ import annotations

from dlprof_agent.reach.safe_point import HANDLER_SCAN_BYTES, in_signal_handler, safe_pc

PYTHON = "/usr/bin/python3.11"
MAPS = [
    (0x400000, 0x800000, "r-xp", 0, PYTHON),
    (0x7F0000000000, 0x7F0000100000, "r-xp", 0, "/opt/torch/lib/libtorch_cpu.so"),
    (0x7F0000200000, 0x7F0000300000, "r-xp", 0, "/usr/lib/x86_64-linux-gnu/libc.so.6"),
    (0x7F0000400000, 0x7F0000500000, "r-xp", 0, "/usr/lib/libpython3.11.so.1.0"),
    (0x7F0000600000, 0x7F0000601000, "r-xp", 0, "[vdso]"),
    (0x7F0000700000, 0x7F0000701000, "rwxp", 0, ""),
    (0x7F0000800000, 0x7F0000900000, "r--p", 0, "/opt/torch/lib/libtorch_cpu.so"),
    (0x7F0000A00000, 0x7F0000B00000, "r-xp", 0, "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"),
]
INTERPRETER = frozenset({PYTHON, "/usr/lib/libpython3.11.so.1.0"})


def test_only_other_libraries_code_is_a_safe_pc() -> None:
    assert safe_pc(0x7F0000000100, MAPS, INTERPRETER)  # libtorch's code
    for pc in (0x400100,  # the interpreter
               0x7F0000200100,  # libc
               0x7F0000400100,  # libpython
               0x7F0000600100,  # the vdso
               0x7F0000700100,  # anonymous (JIT) code
               0x7F0000800100,  # not executable
               0x7F0000A00100,  # the dynamic loader
               0x10):  # nothing mapped
        assert not safe_pc(pc, MAPS, INTERPRETER), hex(pc)


def test_a_restorer_address_above_the_stack_pointer_is_a_handler_in_progress() -> None:
    restorer = 0x7F0000200500
    rsp, end = 0x7FFE0000, 0x7FFF0000
    stack = bytearray(end - rsp)

    def read(address: int, size: int) -> bytes:
        return bytes(stack[address - rsp:address - rsp + size])

    assert not in_signal_handler(read, rsp, end, restorer)
    stack[0x800:0x808] = restorer.to_bytes(8, "little")
    assert in_signal_handler(read, rsp, end, restorer)
    stack[0x800:0x808] = bytes(8)
    stack[HANDLER_SCAN_BYTES + 8:HANDLER_SCAN_BYTES + 16] = restorer.to_bytes(8, "little")
    assert not in_signal_handler(read, rsp, end, restorer), "further up than a handler's frame"

    def unreadable(address: int, size: int) -> bytes:
        raise OSError("gone")

    assert in_signal_handler(unreadable, rsp, end, restorer), "unknown is taken as unsafe"
