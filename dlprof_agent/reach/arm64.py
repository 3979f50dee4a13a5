"""The ptrace injector's place for Linux arm64 (Grace, Graviton, Ampere): how a
stopped thread is read, which waits it may be borrowed from, and the signal frame it
returns through. The plan (``call_plan``) and the borrowing (``ptrace``) are the
x86-64 injector's; only this differs.

The frame (``arch/arm64/kernel/signal.c``, ``uapi/asm/sigcontext.h``): 128 bytes of
siginfo, then the ucontext, whose ``sigcontext`` holds x0-x30, sp, pc and pstate, and
in its 4096 reserved bytes a list of records: the FP/SIMD registers (always), the SVE
registers at the thread's vector length where its SVE state is live, and a closing
empty record. ``rt_sigreturn`` takes the frame at sp, which must be 16-byte aligned,
and restores the thread from it: where its SVE state was live, the Z, P and FFR
registers come back only from an SVE record of the same vector length.

A thread the kernel stopped inside a system call has already been rewound (``do_signal``
before the stop): x0 holds the call's first argument again and pc the ``svc`` that made
it, so restoring the registers as seen restarts the call with its arguments as they
were. That is right for every wait but one kind: a call the kernel would have resumed
through ``restart_syscall`` (a relative sleep, a futex wait with a relative timeout)
then starts its whole timeout again, so such a wait is never borrowed. A thread's SVE
state beyond its V registers does not survive a system call (``fp_user_discard``), so
a waiting thread's frame needs only FP/SIMD; a busy one stopped anywhere gets its SVE
record too. A thread whose state the frame cannot hold (SME's ZA or streaming mode in
use, a guarded control stack) is not borrowed: ``StateNotKept`` says why.

Pointer authentication and BTI: the called function signs and checks its own return
address against its own stack pointer, so any x30 works; it returns with ``ret``, which
BTI does not check; and the thread is set on its way with PSTATE.BTYPE clear, as after
a plain branch, so the first instruction of a guarded function is not required to be a
landing pad for it."""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from typing import NamedTuple

from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import StateNotKept
from dlprof_agent.reach.stopped import Read, Stopped
from dlprof_agent.reach.tracer import Tracer

log = logging.getLogger("dlprof_agent")

# asm-generic/unistd.h, which arm64 uses
READ, EPOLL_PWAIT, PSELECT6, PPOLL, WAITID, FUTEX = 63, 22, 72, 73, 95, 98
NANOSLEEP, CLOCK_NANOSLEEP, RESTART_SYSCALL, RT_SIGRETURN = 101, 115, 128, 139
ACCEPT, RECVFROM, RECVMSG, ACCEPT4, WAIT4, EPOLL_PWAIT2 = 202, 207, 212, 242, 260, 441
# Waits a thread may be borrowed from, as on x86-64 (``threads``): none changes the
# signal mask while it waits; the four with a mask argument only when given none.
BORROWABLE = frozenset({READ, FUTEX, CLOCK_NANOSLEEP, ACCEPT, RECVFROM, RECVMSG, ACCEPT4,
                        WAIT4, WAITID})
MASK_ARGUMENT = {PSELECT6: 5, PPOLL: 3, EPOLL_PWAIT: 4, EPOLL_PWAIT2: 4}
_FUTEX_COMMAND = 0x7F  # without FUTEX_PRIVATE_FLAG and FUTEX_CLOCK_REALTIME
FUTEX_WAIT, FUTEX_WAIT_BITSET = 0, 9
TIMER_ABSTIME = 1
EINTR = 4

SVC = 0xD4000001  # svc #0
# __kernel_rt_sigreturn of the vDSO (glibc's aarch64 signal handlers return there):
# mov x8, #139; svc #0
SIGRETURN_CODE = struct.pack("<II", 0xD2801168, SVC)
_BTYPE = 0b11 << 10  # PSTATE.BTYPE
_NAMES = (*(f"x{n}" for n in range(31)), "sp", "pc", "pstate")
REGISTER_COUNT = len(_NAMES)  # struct user_pt_regs, NT_PRSTATUS

# The frame (arch/arm64/include/uapi/asm/{sigcontext,ucontext}.h)
_SIGINFO_BYTES = 128
_UCONTEXT_AT = _SIGINFO_BYTES
_SIGMASK_AT = _UCONTEXT_AT + 40  # uc_flags, uc_link, uc_stack (24 bytes), then the mask
_MCONTEXT_AT = _UCONTEXT_AT + 176  # after the mask's 128 bytes, aligned to 16
_RESERVED_AT = _MCONTEXT_AT + 288  # fault_address, regs[31], sp, pc, pstate, aligned to 16
RESERVED_BYTES = 4096
FRAME_BYTES = _RESERVED_AT + RESERVED_BYTES
_SS_FLAGS_INVALID = 0x10  # uc_stack: rejected and ignored, so the signal stack stays
# What the kernel reads of the reserved area without an extra context: 4096 bytes less
# the room it keeps for one and its end record (arch/arm64/kernel/signal.c)
_RECORDS_LIMIT = RESERVED_BYTES - 32 - 16
FPSIMD_MAGIC, SVE_MAGIC = 0x46508001, 0x53564501
FPSIMD_BYTES = 528  # head, fpsr, fpcr, then 32 V registers at offset 16
_SVE_HEAD_BYTES = 16  # head, vl, flags, reserved; the registers follow
SVE_FLAG_STREAMING = 1
# Register sets (include/uapi/linux/elf.h)
NT_PRSTATUS, NT_PRFPREG = 1, 2
NT_ARM_SVE, NT_ARM_PAC_MASK, NT_ARM_SSVE, NT_ARM_GCS = 0x405, 0x406, 0x40B, 0x410
NT_ARM_TLS, NT_ARM_ZA, NT_ARM_ZT, NT_ARM_FPMR, NT_ARM_POE = 0x401, 0x40C, 0x40D, 0x40E, 0x40F
# Read before and compared after, each with the most bytes it can have (ZA: 256-byte
# streaming vectors, 16 + 256 * 256)
_COMPARED = {NT_ARM_TLS: 16, NT_ARM_ZA: 16 + 65536, NT_ARM_ZT: 64, NT_ARM_FPMR: 8,
             NT_ARM_POE: 8}
_STATE_NAMES = {NT_PRFPREG: "FP/SIMD", NT_ARM_SVE: "SVE", NT_ARM_TLS: "TLS", NT_ARM_ZA: "ZA",
                NT_ARM_ZT: "ZT0", NT_ARM_FPMR: "FPMR", NT_ARM_POE: "POE"}
_MAX_SVE_BYTES = 16 + 546 * 16 + 32  # vector length 256 bytes, fpsr and fpcr after
_GCS_ENABLED = 1  # PR_SHADOW_STACK_ENABLE in features_enabled
_TAG_BITS = 0xFF << 56  # the top byte, ignored in user addresses
_ADRP_ADD_REACH = 8  # instructions: gcc schedules others between the two
_FRAME_GAP = 256  # between the stopped thread's stack pointer and the frame
# NT_ARM_SVE (struct user_sve_header): its flags' low bit says the payload holds SVE
# registers rather than FP/SIMD ones; the registers sit after the 16-byte header in
# the same layout as after the signal record's.
SVE_PT_REGS_SVE = 1
_USER_SVE_HEADER = struct.Struct("<IIHHHH")


def named(registers: list[int]) -> dict[str, int]:
    return dict(zip(_NAMES, registers, strict=True))


def ordered(registers: dict[str, int]) -> list[int]:
    return [registers[name] % (1 << 64) for name in _NAMES]


def signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


class Stop(NamedTuple):
    """A stopped thread as the injector sees it: the system call it waits in (-1 for
    none), its arguments, and whether the kernel already returned EINTR from it."""

    call: int
    arguments: tuple[int, ...]
    returned_eintr: bool = False


def stop_of(registers: dict[str, int], read: Callable[[int, int], bytes]) -> Stop:
    """Where the thread stopped with ``registers`` is: at the ``svc`` of a call the
    kernel rewound (or about to make it), just after one that returned EINTR, or
    elsewhere (busy)."""
    pc = registers["pc"]
    try:
        at, before = read(pc, 4), read(pc - 4, 4)
    except OSError:
        return Stop(-1, ())
    arguments = tuple(registers[f"x{n}"] for n in range(6))
    if at == struct.pack("<I", SVC):
        return Stop(registers["x8"], arguments)
    if before == struct.pack("<I", SVC) and signed(registers["x0"]) == -EINTR:
        return Stop(registers["x8"], arguments, returned_eintr=True)
    return Stop(-1, ())


def borrowable(number: int, arguments: tuple[int, ...] | list[int]) -> bool:
    """A thread waiting in system call ``number`` with ``arguments`` may be borrowed:
    restarting it as the frame does keeps its meaning, and it leaves the mask alone."""
    if number == FUTEX:
        command = arguments[1] & _FUTEX_COMMAND
        # A relative timeout would start again whole; FUTEX_WAIT_BITSET's is absolute
        return command == FUTEX_WAIT_BITSET or (command == FUTEX_WAIT and arguments[3] == 0)
    if number == CLOCK_NANOSLEEP:
        return bool(arguments[1] & TIMER_ABSTIME)
    if number in BORROWABLE:
        return True
    index = MASK_ARGUMENT.get(number)
    return index is not None and index < len(arguments) and arguments[index] == 0


def _instruction_before(read: Callable[[int, int], bytes], address: int) -> int | None:
    try:
        before = read(address - 4, 4)
    except OSError:
        return None
    return int.from_bytes(before, "little") if len(before) == 4 else None


def after_a_call(read: Callable[[int, int], bytes], address: int) -> bool:
    """``address`` follows ``bl``, ``blr`` or an authenticating ``blra*``: a return
    address."""
    word = _instruction_before(read, address)
    return word is not None and (word & 0xFC000000 == 0x94000000
                                 or word & 0xFFFFFC1F == 0xD63F0000
                                 or word & 0xFEFFF800 == 0xD63F0800)


def calls(read: Callable[[int, int], bytes], address: int, function: int) -> bool:
    """``address`` follows a ``bl`` of ``function``."""
    word = _instruction_before(read, address)
    if word is None or word & 0xFC000000 != 0x94000000:
        return False
    offset = word & 0x3FFFFFF
    offset -= (offset & 1 << 25) << 1  # signed, in instructions
    return address - 4 + 4 * offset == function


def caller_index(words: list[int], top: int, index: int) -> int | None:
    """``words[index]`` (at ``top + 8 * index``) is the x30 of a frame record, stored
    by the callee of the function it returns into: the x29 right below it points to
    that function's own record (AAPCS64's frame chain), whose x30 is returned."""
    if index == 0 or (top + 8 * (index - 1)) % 16:
        return None
    record = words[index - 1] - top
    if record % 16 or record < 8 * (index + 1):
        return None
    caller = record // 8 + 1
    return caller if caller < len(words) else None


def names_address(code: bytes, code_address: int, target: int) -> bool:
    """``code``, loaded at ``code_address``, puts ``target`` in a register: ``adrp`` of
    its 4 KiB page, then, a few instructions later at most, ``add`` (immediate) of the
    rest to that register, as gcc writes a position-independent address."""
    words = struct.unpack_from(f"<{len(code) // 4}I", code)
    for at, word in enumerate(words):
        if word & 0x9F000000 != 0x90000000:  # adrp
            continue
        register = word & 31
        pages = (word >> 5 & 0x7FFFF) << 2 | word >> 29 & 3
        pages -= (pages & 1 << 20) << 1
        page = ((code_address + 4 * at) & ~0xFFF) + (pages << 12)
        for later in words[at + 1:at + 1 + _ADRP_ADD_REACH]:
            # add xd, xn, #imm12{, lsl #12}, xn the adrp's register
            if later & 0xFF800000 == 0x91000000 and later >> 5 & 31 == register:
                shift = 12 if later & 1 << 22 else 0
                if page + ((later >> 10 & 0xFFF) << shift) == target:
                    return True
    return False


class FpState(NamedTuple):
    """A thread's FP/SIMD and SVE state as ptrace gives it: NT_PRFPREG's 528 bytes
    (V0-V31, FPSR, FPCR and padding) and NT_ARM_SVE's header and payload (None where
    the kernel has no SVE); and the other register sets the called functions leave
    alone and the frame does not carry (TLS and TPIDR2, ZA, FPMR, POE), by note, to
    compare once the thread is back."""

    fpsimd: bytes
    sve: bytes | None
    others: tuple[tuple[int, bytes], ...] = ()


def sve_header(sve: bytes) -> tuple[int, int, int]:
    """(size, vl, flags) of an NT_ARM_SVE payload."""
    size, _, vl, _, flags, _ = _USER_SVE_HEADER.unpack_from(sve)
    return size, vl, flags


def live_sve(state: FpState) -> bool:
    return state.sve is not None and bool(sve_header(state.sve)[2] & SVE_PT_REGS_SVE)


def sve_registers_bytes(vl: int) -> int:
    """Z0-Z31, P0-P15 and FFR at vector length ``vl`` bytes."""
    return 32 * vl + 17 * (vl // 8)


def records(state: FpState, *, streaming: bool = False) -> bytes:
    """The reserved area's records for ``state``: FP/SIMD, SVE where live, the end."""
    fpsr, fpcr = struct.unpack_from("<II", state.fpsimd, 512)
    out = struct.pack("<IIII", FPSIMD_MAGIC, FPSIMD_BYTES, fpsr, fpcr) + state.fpsimd[:512]
    if live_sve(state):
        assert state.sve is not None
        _, vl, _ = sve_header(state.sve)
        data = state.sve[_SVE_HEAD_BYTES:_SVE_HEAD_BYTES + sve_registers_bytes(vl)]
        size = _SVE_HEAD_BYTES + len(data)
        if len(data) != sve_registers_bytes(vl):
            raise StateNotKept(f"the kernel's SVE state holds {len(data)} bytes of "
                               f"registers, its vector length {vl} needs "
                               f"{sve_registers_bytes(vl)}")
        padded = -(-size // 16) * 16
        out += struct.pack("<IIHHI", SVE_MAGIC, padded, vl,
                           SVE_FLAG_STREAMING if streaming else 0, 0) + data
        out += bytes(padded - size)
    if len(out) > _RECORDS_LIMIT:
        raise StateNotKept(f"its registers need {len(out)} bytes of signal frame, more "
                           f"than the {_RECORDS_LIMIT} it has without an extra context")
    return out + bytes(8)


def signal_frame(registers: dict[str, int], state: FpState, blocked: int, *,
                 interrupt: bool = False) -> bytes:
    """The rt_sigframe that puts the thread back as ``registers`` and ``state`` say,
    with signal mask ``blocked``. With ``interrupt``, its call (at the ``svc`` pc
    points to) returns EINTR instead of running again, as after a signal handler
    without SA_RESTART."""
    regs = dict(registers)
    if interrupt:
        regs["x0"], regs["pc"] = (1 << 64) - EINTR, regs["pc"] + 4
    frame = bytearray(FRAME_BYTES)
    struct.pack_into("<QQQiiQ", frame, _UCONTEXT_AT, 0, 0, 0, _SS_FLAGS_INVALID, 0, 0)
    struct.pack_into("<Q", frame, _SIGMASK_AT, blocked)
    struct.pack_into(f"<Q{REGISTER_COUNT}Q", frame, _MCONTEXT_AT, 0, *ordered(regs))
    reserved = records(state)
    frame[_RESERVED_AT:_RESERVED_AT + len(reserved)] = reserved
    return bytes(frame)


def call_registers(registers: dict[str, int], frame_at: int, function: int,
                   arguments: tuple[int, ...], gadget: int) -> dict[str, int]:
    """The thread's registers to call ``function(*arguments)`` with its stack at the
    frame and its return into the rt_sigreturn at ``gadget``."""
    new = dict(registers, sp=frame_at, pc=function, x30=gadget,
               pstate=registers["pstate"] & ~_BTYPE)
    for index, value in enumerate(arguments):
        new[f"x{index}"] = value % (1 << 64)
    return new


def in_its_sigreturn(registers: dict[str, int], frame_at: int) -> bool:
    """A system-call stop of the thread is its detour's rt_sigreturn."""
    return registers["x8"] == RT_SIGRETURN and registers["sp"] == frame_at


class Arm64:
    """The ptrace injector's place for arm64 (``cpu``)."""

    name = "arm64"
    futex = FUTEX
    restart_syscall = RESTART_SYSCALL
    sigreturn_code: tuple[bytes, ...] = (SIGRETURN_CODE,)

    def __init__(self, pac_mask: int = 0) -> None:
        # NT_ARM_PAC_MASK's insn_mask, read with the first registers; 0 without PAC
        self._pac_mask = pac_mask

    def borrowable(self, number: int, arguments: tuple[int, ...] | list[int]) -> bool:
        return borrowable(number, arguments)

    def registers(self, ptrace: Tracer, tid: int) -> list[int]:
        data = ptrace.regset(tid, NT_PRSTATUS, 8 * REGISTER_COUNT)
        if data is None or len(data) != 8 * REGISTER_COUNT:
            raise OSError(f"thread {tid}: no general registers from ptrace")
        if not self._pac_mask:
            masks = ptrace.regset(tid, NT_ARM_PAC_MASK, 16)
            self._pac_mask = struct.unpack_from("<Q", masks, 8)[0] if masks else 0
        return list(struct.unpack(f"<{REGISTER_COUNT}Q", data))

    def set_registers(self, ptrace: Tracer, tid: int, registers: list[int]) -> None:
        ptrace.set_regset(tid, NT_PRSTATUS, struct.pack(f"<{REGISTER_COUNT}Q", *registers))

    def stopped(self, registers: list[int], read: Read) -> Stopped:
        r = named(registers)
        stop = stop_of(r, read)
        # At the svc of its call: the kernel rewound it, so it will run again
        return Stopped(registers, r["pc"], r["sp"], stop.call, stop.arguments,
                       interrupted=stop.call >= 0 and not stop.returned_eintr)

    def after_a_call(self, read: Read, address: int) -> bool:
        return after_a_call(read, address)

    def code_address(self, word: int) -> int:
        return word & ~(self._pac_mask | _TAG_BITS)

    def calls(self, read: Read, address: int, function: int) -> bool:
        return calls(read, address, function)

    def caller_index(self, words: list[int], top: int, index: int, read: Read, callee: int
                     ) -> int | None:
        return caller_index(words, top, index)

    def names_address(self, code: bytes, code_address: int, target: int) -> bool:
        return names_address(code, code_address, target)

    def thread_state(self, ptrace: Tracer, target: Target, tid: int) -> FpState:
        gcs = ptrace.regset(tid, NT_ARM_GCS, 24)
        if gcs and struct.unpack_from("<Q", gcs)[0] & _GCS_ENABLED:
            raise StateNotKept("it has a guarded control stack, which a detour's return "
                               "would break")
        streaming = ptrace.regset(tid, NT_ARM_SSVE, _USER_SVE_HEADER.size)
        if streaming and len(streaming) == _USER_SVE_HEADER.size and (
                sve_header(streaming)[2] & SVE_PT_REGS_SVE):
            raise StateNotKept("it runs in SME streaming mode")
        fpsimd = ptrace.regset(tid, NT_PRFPREG, FPSIMD_BYTES)
        if fpsimd is None or len(fpsimd) < 520:
            raise StateNotKept("the kernel gives no FP/SIMD registers of it")
        others = tuple((note, data) for note, size in _COMPARED.items()
                       if (data := ptrace.regset(tid, note, size)) is not None)
        return FpState(fpsimd, ptrace.regset(tid, NT_ARM_SVE, _MAX_SVE_BYTES), others)

    def frame_at(self, sp: int, state: object) -> int:
        return (sp - _FRAME_GAP - FRAME_BYTES) & ~15

    def frame_limit(self, sp: int) -> int:
        return sp

    def frame(self, at: int, stopped: Stopped, state: object, blocked: int, gadget: int, *,
              interrupt: bool) -> bytes:
        assert isinstance(state, FpState)
        return signal_frame(named(stopped.registers), state, blocked, interrupt=interrupt)

    def call_registers(self, stopped: Stopped, at: int, function: int,
                       arguments: tuple[int, ...], gadget: int) -> list[int]:
        return ordered(call_registers(named(stopped.registers), at, function, arguments,
                                      gadget))

    def sigreturn_sp(self, at: int) -> int:
        return at

    def in_sigreturn(self, registers: list[int], sigreturn_sp: int) -> bool:
        return in_its_sigreturn(named(registers), sigreturn_sp)

    def put_back(self, ptrace: Tracer, target: Target, tid: int, state: object) -> None:
        assert isinstance(state, FpState)
        saved = [(NT_ARM_SVE, state.sve) if state.sve is not None else (NT_PRFPREG, state.fpsimd),
                 *state.others]
        lost = []
        for note, before in saved:
            assert before is not None
            if ptrace.regset(tid, note, len(before) + 16) != before:
                ptrace.set_regset(tid, note, before)
                lost.append(_STATE_NAMES[note])
        if lost:
            log.warning("pid %d: thread %d came back from its detour without its %s "
                        "state; put back through ptrace", target.pid, tid, ", ".join(lost))
