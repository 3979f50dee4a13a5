"""The signal frame a borrowed thread returns through (``rt_sigreturn``): its
registers, its interrupted system call set to run again or to return EINTR, its
signal mask, and its whole register state: its XSAVE image (``PTRACE_GETREGSET``
``NT_X86_XSTATE``) cut to the thread's own signal-frame layout, as the kernel
writes it for a signal handler.

Why a frame in the job, and not ptrace alone: the thread then needs nothing from
the agent once it is set on its way, so the agent may die at any instant. The
kernel restores such an image whole (``arch/x86/kernel/fpu/signal.c``) only when
FP_XSTATE_MAGIC1 opens its software-reserved bytes, the size they claim is at
most the thread's own (``fpstate->user_size``) and FP_XSTATE_MAGIC2 follows the
image; else it restores x87 and SSE and resets the rest (AVX's upper halves,
AVX-512's opmasks and ZMM registers, AMX's tiles). ptrace gives the CPU's largest
image, AMX's TILEDATA included, while a thread that never used AMX has a smaller
frame: so the image is cut to the components the thread has (``xsave_layout``:
offsets and sizes from CPUID, XFD-guarded components only where in use), and its
software bytes say that size and those components. Where the agent is still there
when the thread returns, it also compares the state the kernel restored with the
one it saved, and puts any difference back with ``PTRACE_SETREGSET`` (``ptrace``).

Where the state cannot be kept whole (no usable image, a component CPUID does not
place, the CPU's layout unreadable) nothing is borrowed: ``StateNotKept`` says
why. Only a CPU whose OS enabled x87 and SSE alone gets the FXSAVE frame, which is
then all its state."""

from __future__ import annotations

import struct

from dlprof_agent.errors import StateNotKept
from dlprof_agent.reach.lock_wait import EINTR
from dlprof_agent.reach.xsave_layout import (
    HEADER_BYTES,
    LEGACY_BYTES,
    X87_SSE,
    LayoutUnknown,
    XsaveLayout,
    host_layout,
    image_features,
)

NT_X86_XSTATE = 0x202
MAX_XSTATE_BYTES = 64 << 10  # the largest XSAVE area, AMX included, is about 11 KiB
_SOFTWARE_BYTES_AT = 464  # struct _fpx_sw_bytes in the legacy region's reserved tail
_MAGIC1 = 0x46505853  # FP_XSTATE_MAGIC1, first of the software-reserved bytes at 464
_MAGIC2 = 0x46505845  # FP_XSTATE_MAGIC2, the 4 bytes right after the image
_MAGIC2_BYTES = 4
UC_FP_XSTATE = 0x1  # uc_flags: the frame's FPU state is an XSAVE image
# What each state component is, for messages (Intel SDM vol. 1, 13.1)
COMPONENT_NAMES = {0: "x87", 1: "SSE", 2: "AVX", 3: "MPX BNDREGS", 4: "MPX BNDCSR",
                   5: "AVX-512 opmask", 6: "AVX-512 ZMM_Hi256", 7: "AVX-512 Hi16_ZMM",
                   9: "PKRU", 17: "AMX TILECFG", 18: "AMX TILEDATA", 19: "APX"}


def component_names(mask: int) -> str:
    return ", ".join(COMPONENT_NAMES.get(index, f"component {index}")
                     for index in range(64) if mask >> index & 1)


def standard_image(image: bytes | None) -> bool:
    """``image`` is a standard-format XSAVE image as ptrace gives it: x87 and SSE
    enabled, no compaction, nothing in the header's reserved bytes, and no
    component in use that is not enabled."""
    if image is None or len(image) < LEGACY_BYTES + HEADER_BYTES or len(image) % 64:
        return False
    features, xstate_bv = image_features(image)
    xcomp_bv = struct.unpack_from("<Q", image, LEGACY_BYTES + 8)[0]
    reserved = image[LEGACY_BYTES + 16:LEGACY_BYTES + HEADER_BYTES]
    return (features & X87_SSE == X87_SSE and xcomp_bv == 0 and not any(reserved)
            and xstate_bv & ~features == 0)


def frame_state(image: bytes | None, fxsave: bytes, layout: XsaveLayout | None = None
                ) -> tuple[bytes, int]:
    """What goes at the frame's 64-byte aligned FPU state pointer, and the uc_flags
    bit that says which it is: the thread's XSAVE image cut to its own components,
    with the software bytes and closing magic of a signal frame; or, on a CPU with
    x87 and SSE alone, the FXSAVE image. Raises StateNotKept where neither holds the
    thread's whole state. ``layout`` is the CPU's (``host_layout``) unless given."""
    if layout is None:
        try:
            layout = host_layout()
        except LayoutUnknown as error:
            raise StateNotKept(f"cannot read this CPU's XSAVE layout: {error}") from None
    if layout.xcr0 == X87_SSE:
        return fxsave[:_SOFTWARE_BYTES_AT] + bytes(48), 0
    if image is None:
        raise StateNotKept("the kernel gives no XSAVE image of the thread")
    if not standard_image(image):
        raise StateNotKept("the kernel's XSAVE image of the thread is not in the "
                           "standard format")
    enabled, xstate_bv = image_features(image)
    unknown = layout.unknown(enabled | xstate_bv)
    if unknown:
        raise StateNotKept(f"CPUID does not place XSAVE {component_names(unknown)}")
    features = layout.thread_features(xstate_bv) & enabled | X87_SSE
    size = layout.size(features)
    if len(image) < size:
        raise StateNotKept(f"the thread's XSAVE image has {len(image)} bytes, its "
                           f"components {size}")
    software = struct.pack("<IIQI", _MAGIC1, size + _MAGIC2_BYTES, features, size)
    software += bytes(LEGACY_BYTES - _SOFTWARE_BYTES_AT - len(software))
    header = struct.pack("<Q", xstate_bv & features) + image[LEGACY_BYTES + 8:
                                                             LEGACY_BYTES + HEADER_BYTES]
    return (image[:_SOFTWARE_BYTES_AT] + software + header
            + image[LEGACY_BYTES + HEADER_BYTES:size] + struct.pack("<I", _MAGIC2)
            ), UC_FP_XSTATE


def frame_state_bytes(image: bytes | None) -> int:
    """The most bytes ``frame_state`` can give for ``image``."""
    return (len(image) + _MAGIC2_BYTES) if image is not None else LEGACY_BYTES


def state_differences(saved: bytes, restored: bytes, layout: XsaveLayout) -> int:
    """The components whose registers differ between two ptrace images of one thread
    (the kernel fills components not in use with their initial values, so bytes
    compare; the software bytes and the header say only how the state is kept)."""
    differ = 0
    if saved[:160] != restored[:160]:  # x87, with MXCSR at 24
        differ |= 1
    if saved[160:416] != restored[160:416]:
        differ |= 2
    for index, part in layout.components.items():
        end = part.offset + part.size
        if saved[part.offset:end] != restored[part.offset:end]:
            differ |= 1 << index
    return differ


# struct user_regs_struct, in order
REGISTERS = ("r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax",
             "rcx", "rdx", "rsi", "rdi", "orig_rax", "rip", "cs", "eflags", "rsp", "ss",
             "fs_base", "gs_base", "ds", "es", "fs", "gs")
_ERESTART_CODES = (-512, -513, -514)  # ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND


def signed(register: int) -> int:
    return register - (1 << 64) if register >= 1 << 63 else register


def signal_frame(at: int, regs: list[int], fxsave: bytes, blocked: int, gadget: int, *,
                  interrupt: bool = False, xstate: bytes | None = None,
                  layout: XsaveLayout | None = None) -> bytes:
    """What the borrowed thread finds on its stack at ``at`` when the called function
    returns: the address of an rt_sigreturn, then the frame that call restores, which is
    the thread as we stopped it, its interrupted system call set to run again; or, with
    ``interrupt``, to return EINTR, as after a signal handler without SA_RESTART. Its
    FPU state is ``xstate`` as ``frame_state`` cuts it. Raises StateNotKept."""
    r = dict(zip(REGISTERS, regs, strict=True))
    rax, rip = r["rax"], r["rip"]
    if interrupt:
        rax = (1 << 64) - EINTR
    elif signed(r["orig_rax"]) >= 0 and signed(rax) in _ERESTART_CODES:
        rax, rip = r["orig_rax"], rip - 2  # as the kernel restarts it after a ptrace stop
    fx_at = -(-(at + 8 + 304) // 64) * 64
    context = struct.pack(
        "<18Q4H4QQ8Q", r["r8"], r["r9"], r["r10"], r["r11"], r["r12"], r["r13"], r["r14"],
        r["r15"], r["rdi"], r["rsi"], r["rbp"], r["rbx"], r["rdx"], rax, r["rcx"], r["rsp"],
        rip, r["eflags"], r["cs"], 0, 0, r["ss"], 0, 0, 0, 0, fx_at, *([0] * 8))
    state, fp_flag = frame_state(xstate, fxsave, layout)
    # uc_flags UC_SIGCONTEXT_SS | UC_STRICT_RESTORE_SS (and UC_FP_XSTATE with the XSAVE
    # image); uc_stack with an invalid ss_flags, so the kernel keeps the thread's signal
    # stack as it is (it ignores that error).
    ucontext = struct.pack("<QQQiiQ", 6 | fp_flag, 0, 0, 0x10, 0, 0) + context + struct.pack(
        "<Q", blocked)
    frame = struct.pack("<Q", gadget) + ucontext
    return frame + bytes(fx_at - at - len(frame)) + state
