"""Which waits the ptrace injector ends with EINTR (``reach/lock_wait.py``), on a
stand-in memory, and the frame that makes a borrowed thread's wait return it."""

from __future__ import annotations

import struct
from collections.abc import Callable

from dlprof_agent.reach.frame import REGISTERS, signal_frame
from dlprof_agent.reach.lock_wait import STACK_SCAN_BYTES, in_lock_wait

LOCK_FUNCTION = (0x401000, 0x401266)  # [start, end) of PyThread_acquire_lock_timed
STACK_TOP = 0x7FFE0000
FUTEX_WAIT_BITSET_PRIVATE = 0x189


def memory(words: dict[int, int], code: dict[int, bytes]) -> dict[int, int]:
    """Bytes by address: 8-byte words on the stack, and code bytes."""
    found: dict[int, int] = {}
    for address, word in words.items():
        for index, byte in enumerate(word.to_bytes(8, "little")):
            found[address + index] = byte
    for address, data in code.items():
        for index, byte in enumerate(data):
            found[address + index] = byte
    return found


def reader(found: dict[int, int]) -> Callable[[int, int], bytes]:
    def read(address: int, size: int) -> bytes:
        return bytes(found.get(address + index, 0) for index in range(size))
    return read


def registers(**changed: int) -> dict[str, int]:
    return {"orig_rax": 202, "rax": (1 << 64) - 512, "rsi": FUTEX_WAIT_BITSET_PRIVATE,
            "rsp": STACK_TOP - 4096, **changed}


RETURN_ADDRESS = 0x401100  # inside the lock function, after its call to sem_wait
CALL_REL32 = {RETURN_ADDRESS - 5: b"\xe8\x00\x10\x00\x00"}


def test_a_futex_wait_called_from_the_lock_function_is_a_lock_wait() -> None:
    rsp = STACK_TOP - 4096
    read = reader(memory({rsp + 0x98: RETURN_ADDRESS}, CALL_REL32))
    assert in_lock_wait(registers(), read, STACK_TOP, LOCK_FUNCTION)
    timed = registers(rax=(1 << 64) - 516, rsi=0x89)  # a timeout the kernel resumes
    assert in_lock_wait(timed, read, STACK_TOP, LOCK_FUNCTION)
    # The same wait resumed after an earlier stop: restart_syscall, the futex's arguments
    resumed = registers(orig_rax=219, rax=(1 << 64) - 516, rsi=0x89)
    assert in_lock_wait(resumed, read, STACK_TOP, LOCK_FUNCTION)
    through_got = reader(memory({rsp + 0x98: RETURN_ADDRESS},
                                {RETURN_ADDRESS - 6: b"\xff\x15\x00\x10\x00\x00"}))
    assert in_lock_wait(registers(), through_got, STACK_TOP, LOCK_FUNCTION)


def test_other_waits_are_not() -> None:
    rsp = STACK_TOP - 4096
    read = reader(memory({rsp + 0x98: RETURN_ADDRESS}, CALL_REL32))
    assert not in_lock_wait(registers(orig_rax=230), read, STACK_TOP, LOCK_FUNCTION)  # sleep
    assert not in_lock_wait(registers(rsi=0x81), read, STACK_TOP, LOCK_FUNCTION)  # a wake
    assert not in_lock_wait(registers(rax=(1 << 64) - 514), read, STACK_TOP, LOCK_FUNCTION)
    # A futex wait of some other code: nothing of the lock function on the stack
    other = reader(memory({rsp + 0x98: 0x7F0000001234}, CALL_REL32))
    assert not in_lock_wait(registers(), other, STACK_TOP, LOCK_FUNCTION)
    # A stale value inside the lock function that no call left: not a return address
    stale = reader(memory({rsp + 0x98: RETURN_ADDRESS + 3}, CALL_REL32))
    assert not in_lock_wait(registers(), stale, STACK_TOP, LOCK_FUNCTION)
    # Further up than the few frames of libc's semaphore wait
    far = reader(memory({rsp + STACK_SCAN_BYTES + 8: RETURN_ADDRESS}, CALL_REL32))
    assert not in_lock_wait(registers(), far, STACK_TOP, LOCK_FUNCTION)
    # Past the end of the stack's mapping nothing is read
    assert not in_lock_wait(registers(rsp=STACK_TOP), read, STACK_TOP, LOCK_FUNCTION)


def restored(frame: bytes) -> tuple[int, int]:
    """rax and rip of the frame's sigcontext: after the gadget's address, the
    ucontext's flags, link and stack (40 bytes), then r8..rax (14 words), rcx, rsp, rip."""
    context = 8 + 40
    rax = struct.unpack_from("<Q", frame, context + 13 * 8)[0]
    rip = struct.unpack_from("<Q", frame, context + 16 * 8)[0]
    return rax, rip


def test_the_frame_restarts_a_wait_or_ends_it_with_eintr() -> None:
    values = dict.fromkeys(REGISTERS, 0)
    values.update(rax=(1 << 64) - 512, orig_rax=202, rip=0x7F0000002000, rsp=STACK_TOP - 4096)
    regs = [values[name] for name in REGISTERS]
    at = STACK_TOP - 8192 - 8
    restart = signal_frame(at, regs, bytes(512), 0, 0x7F0000003000)
    assert restored(restart) == (202, 0x7F0000002000 - 2)  # the syscall again
    interrupted = signal_frame(at, regs, bytes(512), 0, 0x7F0000003000, interrupt=True)
    assert restored(interrupted) == ((1 << 64) - 4, 0x7F0000002000)  # returns -EINTR
