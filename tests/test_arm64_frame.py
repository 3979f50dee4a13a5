"""The ptrace injector's arm64 place (``reach/arm64.py``) on any machine: the signal
frame against the kernel's layout, which stops may be borrowed, and how a call is set
up. The offsets and encodings are the kernel's and the architecture's, cited each
where it is used; that a real thread comes back whole is for the emulated Grace guest
(``scripts/arm64-check``)."""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest

from dlprof_agent.errors import StateNotKept
from dlprof_agent.reach import arm64
from dlprof_agent.reach.arm64 import Arm64, FpState

# arch/arm64/include/uapi/asm/{sigcontext,ucontext}.h and asm-generic/signal.h: the
# frame is siginfo (128 bytes), then the ucontext; in it uc_sigmask at 40, and
# uc_mcontext, 16-byte aligned, at 176; in that, regs[31] at 8, then sp, pc, pstate,
# and __reserved, 16-byte aligned, at 288, for 4096 bytes.
SIGMASK_AT, REGS_AT, RESERVED_AT, FRAME_BYTES = 168, 312, 592, 4688
SS_FLAGS_AT = 152
PC = 0x0000_FFFF_8000_1234
SVC = struct.pack("<I", 0xD4000001)


def registers(**changed: int) -> dict[str, int]:
    values = {f"x{n}": 0x1000 + n for n in range(31)}
    values.update(sp=0x0000_FFFF_F000_0000, pc=PC, pstate=0x6000_0000, x8=arm64.FUTEX)
    values.update(changed)
    return values


def code_at(words: dict[int, bytes]) -> Callable[[int, int], bytes]:
    def read(address: int, size: int) -> bytes:
        if address not in words:
            raise OSError("unmapped")
        return words[address][:size]
    return read


FPSIMD = bytes(range(256)) * 2 + struct.pack("<II", 0x08000000, 0x03C00000) + bytes(8)


def sve_payload(vl: int, live: bool) -> bytes:
    """NT_ARM_SVE as ptrace gives it: struct user_sve_header (size, max_size, vl,
    max_vl, flags, reserved), then the registers."""
    body = (bytes((n * 7) % 251 for n in range(arm64.sve_registers_bytes(vl))) + bytes(16)
            if live else FPSIMD)
    header = struct.pack("<IIHHHH", 16 + len(body), 16 + len(body), vl, 256,
                         arm64.SVE_PT_REGS_SVE if live else 0, 0)
    return header + body


def test_the_frame_is_laid_out_as_the_kernel_reads_it() -> None:
    regs = registers()
    frame = arm64.signal_frame(regs, FpState(FPSIMD, None), blocked=0x4002)
    assert len(frame) == FRAME_BYTES
    assert struct.unpack_from("<Q", frame, SIGMASK_AT)[0] == 0x4002
    assert struct.unpack_from("<31Q", frame, REGS_AT) == tuple(regs[f"x{n}"] for n in range(31))
    assert struct.unpack_from("<3Q", frame, REGS_AT + 31 * 8) == (regs["sp"], PC, 0x6000_0000)
    # An ss_flags sigaltstack rejects (EINVAL, which rt_sigreturn ignores): the thread's
    # signal stack stays as it is; SS_DISABLE (2) would turn it off
    assert struct.unpack_from("<i", frame, SS_FLAGS_AT)[0] not in (0, 1, 2)
    # fpsimd_context: magic, size 528, fpsr, fpcr, then V0-V31 at 16; then the end record
    magic, size, fpsr, fpcr = struct.unpack_from("<IIII", frame, RESERVED_AT)
    assert (magic, size, fpsr, fpcr) == (0x46508001, 528, 0x08000000, 0x03C00000)
    assert frame[RESERVED_AT + 16:RESERVED_AT + 528] == FPSIMD[:512]
    assert frame[RESERVED_AT + 528:RESERVED_AT + 536] == bytes(8)


@pytest.mark.parametrize("vl", [16, 32, 64])  # Grace's 128-bit SVE2 up to 512-bit
def test_live_sve_registers_go_in_an_sve_record_at_the_thread_s_vector_length(vl: int) -> None:
    vq = vl // 16
    payload = sve_payload(vl, live=True)
    state = FpState(FPSIMD, payload)
    frame = arm64.signal_frame(registers(), state, blocked=0)
    sve_at = RESERVED_AT + 528
    magic, size, record_vl, flags = struct.unpack_from("<IIHH", frame, sve_at)
    # sve_context.h: SVE_SIG_CONTEXT_SIZE(vq) = 16 + 546 vq, rounded up to 16
    assert (magic, record_vl, flags) == (0x53564501, vl, 0)
    assert size == -(-(16 + 546 * vq) // 16) * 16
    # Z0-Z31, P0-P15, FFR in the same layout after each header
    assert frame[sve_at + 16:sve_at + 16 + 546 * vq] == payload[16:16 + 546 * vq]
    assert frame[sve_at + size:sve_at + size + 8] == bytes(8)  # the end


def test_sve_in_fpsimd_form_needs_no_record() -> None:
    """A thread in a system call: its SVE state is gone beyond the V registers."""
    frame = arm64.signal_frame(registers(), FpState(FPSIMD, sve_payload(16, live=False)), 0)
    assert frame[RESERVED_AT + 528:RESERVED_AT + 536] == bytes(8)


def test_registers_past_the_reserved_area_are_refused() -> None:
    """A vector length of 128 bytes would need an extra context: not borrowed."""
    with pytest.raises(StateNotKept, match="more than the 4048"):
        arm64.signal_frame(registers(), FpState(FPSIMD, sve_payload(128, live=True)), 0)


def test_a_call_the_kernel_rewound_is_seen_at_its_svc() -> None:
    """do_signal rewinds an interrupted call before the stop: pc at its svc, x0 its
    first argument again."""
    stop = arm64.stop_of(registers(), code_at({PC: SVC, PC - 4: b"\0" * 4}))
    assert stop.call == arm64.FUTEX and stop.arguments[1] == 0x1001
    assert not stop.returned_eintr
    eintr = registers(x0=(1 << 64) - 4, x8=arm64.EPOLL_PWAIT)
    stop = arm64.stop_of(eintr, code_at({PC: b"\0" * 4, PC - 4: SVC}))
    assert stop.call == arm64.EPOLL_PWAIT and stop.returned_eintr
    # Anywhere else, or just after a call that returned: busy
    assert arm64.stop_of(registers(), code_at({PC: b"\0" * 4, PC - 4: SVC})).call == -1
    assert arm64.stop_of(registers(), code_at({})).call == -1


@pytest.mark.parametrize(("call", "arguments", "borrowed"), [
    (arm64.FUTEX, (0, 0x80, 1, 0), True),  # FUTEX_WAIT_PRIVATE, no timeout
    (arm64.FUTEX, (0, 0x80, 1, 0x7FFF0000), False),  # a relative timeout: starts again
    (arm64.FUTEX, (0, 0x189, 1, 0x7FFF0000), True),  # WAIT_BITSET: an absolute one
    (arm64.FUTEX, (0, 0x81, 1, 0), False),  # a wake
    (arm64.CLOCK_NANOSLEEP, (1, 1, 0x7FFF0000, 0), True),  # TIMER_ABSTIME (time.sleep)
    (arm64.CLOCK_NANOSLEEP, (1, 0, 0x7FFF0000, 0), False),
    (arm64.NANOSLEEP, (0x7FFF0000, 0), False),
    (arm64.RESTART_SYSCALL, (), False),  # rt_sigreturn would make it EINTR
    (arm64.READ, (3, 0x7FFF0000, 4096), True),
    (arm64.PPOLL, (0x7FFF0000, 1, 0x7FFF1000, 0, 8), True),
    (arm64.PPOLL, (0x7FFF0000, 1, 0x7FFF1000, 0x7FFF2000, 8), False),  # a mask: changed
    (arm64.EPOLL_PWAIT, (3, 0x7FFF0000, 8, -1, 0, 8), True),
])
def test_which_waits_are_borrowed(call: int, arguments: tuple[int, ...],
                                  borrowed: bool) -> None:
    assert arm64.borrowable(call, arguments + (0,) * (6 - len(arguments))) is borrowed


def test_a_lock_wait_ends_with_eintr_after_its_svc() -> None:
    frame = arm64.signal_frame(registers(), FpState(FPSIMD, None), 0, interrupt=True)
    x0, = struct.unpack_from("<Q", frame, REGS_AT)
    pc, = struct.unpack_from("<Q", frame, REGS_AT + 32 * 8)
    assert (x0, pc) == ((1 << 64) - 4, PC + 4)


def test_the_call_returns_into_rt_sigreturn_with_its_stack_on_the_frame() -> None:
    btype_j = 0b01 << 10  # stopped just after an indirect branch
    regs = registers(pstate=0x6000_0000 | btype_j)
    new = arm64.call_registers(regs, 0xFFFF_E000_0000, 0xAAAA_0000, (7, 8), gadget=0xBBBB_0000)
    assert (new["pc"], new["sp"], new["x30"]) == (0xAAAA_0000, 0xFFFF_E000_0000, 0xBBBB_0000)
    assert (new["x0"], new["x1"], new["x2"]) == (7, 8, regs["x2"])
    # PSTATE.BTYPE clear: no landing pad is required of the function's first instruction
    assert new["pstate"] == 0x6000_0000
    # arch/arm64/kernel/vdso/sigreturn.S: mov x8, #__NR_rt_sigreturn (139); svc #0
    assert bytes.fromhex("681180d2" "010000d4") == arm64.SIGRETURN_CODE
    assert arm64.in_its_sigreturn(dict(new, x8=139, sp=0xFFFF_E000_0000), 0xFFFF_E000_0000)
    assert not arm64.in_its_sigreturn(dict(new, x8=222), 0xFFFF_E000_0000)


@pytest.mark.parametrize(("instruction", "is_call"), [
    (0x94000010, True),  # bl
    (0xD63F0200, True),  # blr x16
    (0xD63F0A1F, True),  # blraaz x16
    (0xD65F03C0, False),  # ret
    (0x14000010, False),  # b
    (0xD61F0200, False),  # br x16
])
def test_return_addresses_follow_a_call(instruction: int, is_call: bool) -> None:
    read = code_at({0x400FFC: struct.pack("<I", instruction)})
    assert arm64.after_a_call(read, 0x401000) is is_call


def test_a_stored_return_address_loses_its_authentication_code() -> None:
    place = Arm64()
    place._pac_mask = 0x007F_0000_0000_0000  # NT_ARM_PAC_MASK's insn_mask, 48-bit VA
    signed = 0x003A_FFFF_8000_1234
    assert place.code_address(signed) == 0x0000_FFFF_8000_1234
    assert place.code_address(0x0000_FFFF_8000_1234) == 0x0000_FFFF_8000_1234
