"""Which waits the ptrace injector ends with EINTR (``reach/lock_wait.py``), on a
stand-in memory: 3.9-3.12's lock wait, and 3.13's parking lot (Park's own wait, never
the raw mutex's), and 3.14's through the copy of Park its Debian build calls (addresses
as there); and the frame that makes a borrowed thread's wait return it."""

from __future__ import annotations

import struct
from collections.abc import Callable

from dlprof_agent.reach import arm64, lock_wait
from dlprof_agent.reach.arm64 import Arm64
from dlprof_agent.reach.frame import REGISTERS, signal_frame
from dlprof_agent.reach.lock_wait import (
    STACK_SCAN_BYTES,
    ParkingLotWait,
    frame_bytes,
    waits_in_parking_lot,
)
from dlprof_agent.reach.pending_mutex import PENDING_MAINTHREAD_OFFSET_3_13, pending_mutex_address
from dlprof_agent.reach.stopped import Stopped
from dlprof_agent.reach.x86_64 import X86_64
from dlprof_agent.reach.xsave_layout import X87_SSE, XsaveLayout

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


def in_lock_wait(named: dict[str, int], read: Callable[[int, int], bytes], stack_end: int,
                 lock_function: lock_wait.LockWait) -> bool:
    """lock_wait.in_lock_wait for a thread stopped with the x86-64 registers ``named``
    (the others 0)."""
    cpu = X86_64()
    values = dict.fromkeys(REGISTERS, 0) | named
    stopped = cpu.stopped([values[name] for name in REGISTERS], read)
    return lock_wait.in_lock_wait(cpu, stopped, read, stack_end, lock_function)


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
    # The FPU state is another test's (test_avx_frame): the FXSAVE frame of an x87/SSE CPU
    sse_only = XsaveLayout(X87_SSE, {})
    restart = signal_frame(at, regs, bytes(512), 0, 0x7F0000003000, layout=sse_only)
    assert restored(restart) == (202, 0x7F0000002000 - 2)  # the syscall again
    interrupted = signal_frame(at, regs, bytes(512), 0, 0x7F0000003000, interrupt=True,
                               layout=sse_only)
    assert restored(interrupted) == ((1 << 64) - 4, 0x7F0000002000)  # returns -EINTR


# Prologues of _PySemaphore_Wait as Debian's 3.13 and 3.14 and a 3.11 build start them
TRIXIE_PROLOGUE = bytes.fromhex("f30f1efa 4154 4989fc 55 4889f5 53 4883ec20 85d2")
SID_PROLOGUE = bytes.fromhex("f30f1efa 53 4889f9 4883ec30 85d2")
# sid's 3.14 copy of _PyParkingLot_Park, as PyEvent_WaitTimed and the lock waits call it
SID_PARK_COPY_PROLOGUE = bytes.fromhex(
    "f30f1efa 4157 4989f9 31c0 4156 4589c6 4155 4989d5 4889ca b90e000000 4154 55 53 "
    "bb01010000 4883ec68")
PUSHES_AND_IMMEDIATE = bytes.fromhex("4156 4155 4189d5 4154 55 4889fd 48c7c7ffffffff 53 "
                                     "4881ec00010000")


def test_the_frame_of_a_prologue() -> None:
    assert frame_bytes(TRIXIE_PROLOGUE) == 3 * 8 + 0x20
    assert frame_bytes(SID_PROLOGUE) == 8 + 0x30
    assert frame_bytes(PUSHES_AND_IMMEDIATE) == 5 * 8 + 0x100
    assert frame_bytes(bytes.fromhex("55 4889e5 e800000000")) is None  # a call: unknown
    assert frame_bytes(bytes.fromhex("53 4889f9")) is None  # ends before its frame
    assert frame_bytes(SID_PARK_COPY_PROLOGUE) == 6 * 8 + 0x68  # with xor and mov $imm32


SEMAPHORE_WAIT = (0x643F80, 0x64403C)
PARK = (0x643C50, 0x643DBC)
PARKING_LOT = ParkingLotWait(SEMAPHORE_WAIT, PARK)
IN_SEMAPHORE_WAIT = 0x643FC1  # after its call of sem_wait (through the PLT)
IN_PARK = 0x643D32  # after Park's call of _PySemaphore_Wait
IN_RAW_MUTEX = 0x73C774  # after the raw mutex's call of _PySemaphore_Wait


def _call(at: int, target: int) -> dict[int, bytes]:
    """``call rel32`` of ``target`` right before the return address ``at``."""
    return {at - 5: b"\xe8" + (target - at).to_bytes(4, "little", signed=True)}


def parked(words: dict[int, int]) -> Callable[[int, int], bytes]:
    code = {SEMAPHORE_WAIT[0]: TRIXIE_PROLOGUE, **_call(IN_SEMAPHORE_WAIT, 0x420730),
            **_call(IN_PARK, SEMAPHORE_WAIT[0]), **_call(IN_RAW_MUTEX, SEMAPHORE_WAIT[0]),
            **_call(0x59D99B, 0x59D9D0)}
    return reader(memory(words, code))


def test_parks_own_wait_in_the_parking_lot_is_a_lock_wait() -> None:
    rsp = STACK_TOP - 4096
    # libc's frames, the return into _PySemaphore_Wait, its frame (56 bytes, here with
    # a stale return address of an earlier call in it), then the return into Park
    stack = {rsp + 8: 0x7F0000001234, rsp + 120: IN_SEMAPHORE_WAIT, rsp + 136: 0x59D99B,
             rsp + 184: IN_PARK}
    assert in_lock_wait(registers(), parked(stack), STACK_TOP, PARKING_LOT)
    resumed = registers(orig_rax=219, rax=(1 << 64) - 516, rsi=0x89)
    assert in_lock_wait(resumed, parked(stack), STACK_TOP, PARKING_LOT)


def test_other_waits_on_the_parking_lots_semaphore_are_not() -> None:
    rsp = STACK_TOP - 4096
    # The bucket's raw mutex: its caller ignores EINTR and would queue itself twice
    raw = {rsp + 120: IN_SEMAPHORE_WAIT, rsp + 184: IN_RAW_MUTEX, rsp + 232: IN_PARK}
    assert not in_lock_wait(registers(), parked(raw), STACK_TOP, PARKING_LOT)
    # Park's address one word off the end of _PySemaphore_Wait's frame: not its caller
    off = {rsp + 120: IN_SEMAPHORE_WAIT, rsp + 192: IN_PARK}
    assert not in_lock_wait(registers(), parked(off), STACK_TOP, PARKING_LOT)
    # A return into Park after a call of another function
    other = {rsp + 120: IN_SEMAPHORE_WAIT, rsp + 184: PARK[0] + 0x114}
    assert not in_lock_wait(registers(), reader(memory(other, {
        SEMAPHORE_WAIT[0]: TRIXIE_PROLOGUE, **_call(IN_SEMAPHORE_WAIT, 0x420730),
        **_call(PARK[0] + 0x114, 0x73C720)})), STACK_TOP, PARKING_LOT)
    # Nothing of _PySemaphore_Wait on the stack; a sleep
    assert not in_lock_wait(registers(), parked({rsp + 184: IN_PARK}), STACK_TOP, PARKING_LOT)
    good = {rsp + 120: IN_SEMAPHORE_WAIT, rsp + 184: IN_PARK}
    assert not in_lock_wait(registers(orig_rax=230), parked(good), STACK_TOP, PARKING_LOT)
    # A prologue it cannot read: the frame's size is unknown, the wait is left alone
    unknown = reader(memory(good, {SEMAPHORE_WAIT[0]: bytes.fromhex("55 e800000000"),
                                   **_call(IN_SEMAPHORE_WAIT, 0x420730),
                                   **_call(IN_PARK, SEMAPHORE_WAIT[0])}))
    assert not in_lock_wait(registers(), unknown, STACK_TOP, PARKING_LOT)


SID_SEMAPHORE_WAIT = (0x74E1C0, 0x74E25E)
SID_PARK = (0x74CC20, 0x74CE62)
SID_PARK_COPY = 0x74CA40  # no symbol of its own
SID_PARKING_LOT = ParkingLotWait(SID_SEMAPHORE_WAIT, SID_PARK,
                                 ((SID_PARK_COPY, SID_PARK_COPY + 2 * 0x242),))
SID_IN_SEMAPHORE_WAIT = 0x74E1E3  # after its call of sem_wait
SID_IN_COPY = 0x74CB37  # after the copy's call of _PySemaphore_Wait
SID_IN_EVENT_WAIT = 0x74C890  # after PyEvent_WaitTimed's call of the copy
SID_IN_LOCK = 0x68DC9F  # after the thread lock's (inlined) call of the copy


def sid(words: dict[int, int]) -> Callable[[int, int], bytes]:
    code = {SID_SEMAPHORE_WAIT[0]: SID_PROLOGUE, SID_PARK_COPY: SID_PARK_COPY_PROLOGUE,
            **_call(SID_IN_SEMAPHORE_WAIT, 0x4227A0),
            **_call(SID_IN_COPY, SID_SEMAPHORE_WAIT[0]),
            **_call(SID_IN_EVENT_WAIT, SID_PARK_COPY), **_call(SID_IN_LOCK, SID_PARK_COPY),
            **_call(IN_RAW_MUTEX, SID_SEMAPHORE_WAIT[0])}
    return reader(memory(words, code))


def test_a_wait_in_3_14s_copy_of_park_is_a_lock_wait() -> None:
    rsp = STACK_TOP - 4096
    # As in a sid job's join() and lock.acquire(): _PySemaphore_Wait's return at word
    # 20, the copy's at 28, the copy's caller's 1 + 152 / 8 words above it
    for caller in (SID_IN_EVENT_WAIT, SID_IN_LOCK):
        stack = {rsp + 160: SID_IN_SEMAPHORE_WAIT, rsp + 224: SID_IN_COPY,
                 rsp + 384: caller}
        assert in_lock_wait(registers(), sid(stack), STACK_TOP, SID_PARKING_LOT)


def test_other_waits_through_3_14s_semaphore_are_not() -> None:
    rsp = STACK_TOP - 4096
    # The caller's return address a word off the copy's frame
    off = {rsp + 160: SID_IN_SEMAPHORE_WAIT, rsp + 224: SID_IN_COPY,
           rsp + 392: SID_IN_LOCK}
    assert not in_lock_wait(registers(), sid(off), STACK_TOP, SID_PARKING_LOT)
    # The raw mutex's wait, with a stale return of the copy's caller where it would be
    raw = {rsp + 160: SID_IN_SEMAPHORE_WAIT, rsp + 224: IN_RAW_MUTEX,
           rsp + 384: SID_IN_LOCK}
    assert not in_lock_wait(registers(), sid(raw), STACK_TOP, SID_PARKING_LOT)
    # Without the copy known, only Park's own call counts
    good = {rsp + 160: SID_IN_SEMAPHORE_WAIT, rsp + 224: SID_IN_COPY,
            rsp + 384: SID_IN_LOCK}
    assert not in_lock_wait(registers(), sid(good), STACK_TOP,
                            ParkingLotWait(SID_SEMAPHORE_WAIT, SID_PARK))


def test_a_thread_seen_through_its_syscall_file_waits_in_the_parking_lot() -> None:
    rsp = STACK_TOP - 4096
    stack = {rsp + 160: SID_IN_SEMAPHORE_WAIT, rsp + 224: SID_IN_COPY,
             rsp + 384: SID_IN_LOCK}
    line = ["202", "0x1", hex(FUTEX_WAIT_BITSET_PRIVATE), "0x0", "0x0", "0x0",
            "0xffffffff", hex(rsp), "0x7f0000000000"]
    assert waits_in_parking_lot(X86_64(), line, sid(stack), STACK_TOP, SID_PARKING_LOT)
    sleep = ["230", *line[1:]]
    assert not waits_in_parking_lot(X86_64(), sleep, sid(stack), STACK_TOP, SID_PARKING_LOT)
    wake = [line[0], line[1], "0x81", *line[3:]]
    assert not waits_in_parking_lot(X86_64(), wake, sid(stack), STACK_TOP, SID_PARKING_LOT)
    assert not waits_in_parking_lot(X86_64(), ["running"], sid(stack), STACK_TOP, SID_PARKING_LOT)


# arm64: Debian trixie's python3.13 (3.13.5-2+deb13u5), its addresses and instructions.
# A frame record is (x29, x30), x29 pointing at the caller's record; x30 is signed with
# pointer authentication, its code above the address bits.
A64_SEMAPHORE_WAIT = (0x5F16B0, 0x5F17AC)
A64_PARK = (0x5F1024, 0x5F128C)
A64_PARKING_LOT = ParkingLotWait(A64_SEMAPHORE_WAIT, A64_PARK)
A64_CODE = {0x5F1704: 0x97F8B843,  # bl sem_wait@plt, in _PySemaphore_Wait
            0x5F111C: 0x94000165,  # bl _PySemaphore_Wait, in Park
            0x5F1274: 0x9400010F,  # and its second call, with no timeout
            0x733F8C: 0x97FAF5C9}  # bl _PySemaphore_Wait, in the raw mutex's slow lock
A64_IN_SEMAPHORE_WAIT, A64_IN_PARK, A64_IN_RAW_MUTEX = 0x5F1708, 0x5F1120, 0x733F90
A64_PAC_MASK = 0x007F_0000_0000_0000
A64_FUTEX = 98


def a64(*instructions: int) -> bytes:
    return b"".join(word.to_bytes(4, "little") for word in instructions)


def signed_by_pac(address: int) -> int:
    return address | 0x0035_0000_0000_0000


def a64_stack(sp: int, records: list[tuple[int, int, int]]) -> Callable[[int, int], bytes]:
    """Memory holding frame records (where, x29, x30) above ``sp`` and A64_CODE."""
    words = {sp + 8: 0x0000FFFF12345678}  # a word of libc's frames
    for at, frame_pointer, link in records:
        words[at], words[at + 8] = frame_pointer, link
    return reader(memory(words, {at: a64(word) for at, word in A64_CODE.items()}))


def a64_in_lock_wait(read: Callable[[int, int], bytes], sp: int, *, call: int = A64_FUTEX,
                     command: int = FUTEX_WAIT_BITSET_PRIVATE,
                     wait: ParkingLotWait = A64_PARKING_LOT) -> bool:
    stopped = Stopped([0] * 34, 0x0000FFFF00001000, sp, call, (0x1, command, 0, 0, 0, 0),
                      interrupted=True)
    return lock_wait.in_lock_wait(Arm64(A64_PAC_MASK), stopped, read, STACK_TOP, wait)


def test_on_arm64_parks_own_wait_is_found_through_the_frame_records() -> None:
    sp = STACK_TOP - 4096
    # libc's record returns into _PySemaphore_Wait; its x29 points at _PySemaphore_Wait's
    # record, which returns into Park right after Park's bl of it
    for in_park in (A64_IN_PARK, 0x5F1278):
        stack = a64_stack(sp, [(sp + 96, sp + 192, signed_by_pac(A64_IN_SEMAPHORE_WAIT)),
                               (sp + 192, sp + 320, signed_by_pac(in_park))])
        assert a64_in_lock_wait(stack, sp)
    # Resumed as restart_syscall after an earlier stop
    assert a64_in_lock_wait(stack, sp, call=128)


def test_on_arm64_other_waits_on_the_semaphore_are_not() -> None:
    sp = STACK_TOP - 4096
    in_semaphore_wait = signed_by_pac(A64_IN_SEMAPHORE_WAIT)
    # The raw mutex's wait: its caller ignores EINTR
    raw = a64_stack(sp, [(sp + 96, sp + 192, in_semaphore_wait),
                         (sp + 192, sp + 320, signed_by_pac(A64_IN_RAW_MUTEX))])
    assert not a64_in_lock_wait(raw, sp)
    # A stale return into Park on the stack, but the chain leads to the raw mutex's
    stale = a64_stack(sp, [(sp + 96, sp + 192, in_semaphore_wait),
                           (sp + 144, sp + 400, signed_by_pac(A64_IN_PARK)),
                           (sp + 192, sp + 320, signed_by_pac(A64_IN_RAW_MUTEX))])
    assert not a64_in_lock_wait(stale, sp)
    # x29 pointing below its own record, or off the 16-byte grid: no chain
    for frame_pointer in (sp + 32, sp + 200):
        broken = a64_stack(sp, [(sp + 96, frame_pointer, in_semaphore_wait),
                                (sp + 192, sp + 320, signed_by_pac(A64_IN_PARK))])
        assert not a64_in_lock_wait(broken, sp)
    # A return address into Park after a call of another function
    other = a64_stack(sp, [(sp + 96, sp + 192, in_semaphore_wait),
                           (sp + 192, sp + 320, signed_by_pac(A64_PARK[0] + 0x40))])
    assert not a64_in_lock_wait(other, sp)
    good = a64_stack(sp, [(sp + 96, sp + 192, in_semaphore_wait),
                          (sp + 192, sp + 320, signed_by_pac(A64_IN_PARK))])
    assert not a64_in_lock_wait(good, sp, call=101)  # nanosleep
    assert not a64_in_lock_wait(good, sp, command=0x81)  # a wake
    # Without the PAC mask the signed addresses are no code addresses at all
    stopped = Stopped([0] * 34, 0, sp, A64_FUTEX, (0x1, FUTEX_WAIT_BITSET_PRIVATE, 0, 0, 0, 0),
                      interrupted=True)
    assert not lock_wait.in_lock_wait(Arm64(), stopped, good, STACK_TOP, A64_PARKING_LOT)


def test_on_arm64_a_thread_seen_through_its_syscall_file_waits_in_the_parking_lot() -> None:
    sp = STACK_TOP - 4096
    stack = a64_stack(sp, [(sp + 96, sp + 192, signed_by_pac(A64_IN_SEMAPHORE_WAIT)),
                           (sp + 192, sp + 320, signed_by_pac(A64_IN_PARK))])
    line = [str(A64_FUTEX), "0x1", hex(FUTEX_WAIT_BITSET_PRIVATE), "0x0", "0x0", "0x0",
            "0xffffffff", hex(sp), "0xffff00001000"]
    cpu = Arm64(A64_PAC_MASK)
    assert waits_in_parking_lot(cpu, line, stack, STACK_TOP, A64_PARKING_LOT)
    assert not waits_in_parking_lot(cpu, ["202", *line[1:]], stack, STACK_TOP, A64_PARKING_LOT)


def test_on_arm64_the_pending_call_mutex_is_found_by_adrp_and_add() -> None:
    # _PyEval_AddPendingCall+0x108: adrp x1 and ldr x1 (a GOT slot), add x1, #0x18, bl,
    # b; then the main thread's queue: adrp x19, add x19, #0xe8
    code = a64(0xD0002061, 0xD2800080, 0xF9449821, 0x91006021, 0x94046C72, 0x17FFFFF1,
               0xF0002073, 0x9103A273)
    at, runtime_state = 0x619468, 0xA27698  # _PyRuntime
    queue = runtime_state + PENDING_MAINTHREAD_OFFSET_3_13
    assert arm64.names_address(code, at, queue)
    assert pending_mutex_address(runtime_state, code, at, arm64.names_address) == queue + 8
    # Not an address the code does not make: one byte off, or loaded through the GOT
    assert not arm64.names_address(code, at, queue + 1)
    assert not arm64.names_address(code, at, 0xA27000 + 2352)
    # The add may write another register; it must read the adrp's
    other = code[:-4] + a64(0x9103A262)  # add x2, x19, #0xe8: the adrp's register read
    assert arm64.names_address(other, at, queue)
    unrelated = code[:-4] + a64(0x9103A022)  # add x2, x1, #0xe8
    assert not arm64.names_address(unrelated, at, queue)
    # x86-64's reading finds nothing in arm64 code
    assert pending_mutex_address(runtime_state, code, at) is None


def test_arm64_bl_targets_are_decoded_both_ways() -> None:
    read = reader(memory({}, {at: a64(word) for at, word in A64_CODE.items()}))
    assert arm64.calls(read, A64_IN_PARK, A64_SEMAPHORE_WAIT[0])  # forward
    assert arm64.calls(read, A64_IN_RAW_MUTEX, A64_SEMAPHORE_WAIT[0])  # backward
    assert arm64.calls(read, A64_IN_SEMAPHORE_WAIT, 0x41F810)  # to the PLT
    assert not arm64.calls(read, A64_IN_PARK, A64_SEMAPHORE_WAIT[0] + 4)
    assert not arm64.calls(read, A64_IN_PARK + 4, A64_SEMAPHORE_WAIT[0])  # no bl there
