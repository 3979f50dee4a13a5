"""The signal frame a borrowed thread returns through (``rt_sigreturn``): its
registers, its interrupted system call set to run again or to return EINTR, its
signal mask, and its FPU, SSE and AVX state: its full XSAVE image
(``PTRACE_GETREGSET`` ``NT_X86_XSTATE``) in the signal frame, as the kernel
writes it for a signal handler, or the FXSAVE image where that cannot be had.

With only the FXSAVE image, ``rt_sigreturn`` restores x87 and SSE and resets the
rest: the upper halves of the AVX registers, and AVX-512's, come back as zeros.
That is harmless across a system call (libc's wrappers leave nothing live there),
not in the middle of a oneDNN or MKL kernel. With the XSAVE image the kernel
restores all of it (``arch/x86/kernel/fpu/signal.c``: it checks FP_XSTATE_MAGIC1
in the image's software-reserved bytes, the size they give, and FP_XSTATE_MAGIC2
right after the image; a size larger than the thread's own makes it restore the
FXSAVE part only). ptrace gives the standard (uncompacted) layout with XCR0 in
those software bytes, as in a core dump; the frame puts a signal frame's there.
An image whose header is not plain standard format is not used: the kernel
would turn a bad one into a SIGSEGV of the job, where the FXSAVE image only
loses the upper halves."""

from __future__ import annotations

import struct

from dlprof_agent.reach.lock_wait import EINTR

NT_X86_XSTATE = 0x202
MAX_XSTATE_BYTES = 64 << 10  # the largest XSAVE area, AMX included, is about 11 KiB
_FXSAVE_BYTES = 512
_HEADER_BYTES = 64  # xstate_bv, xcomp_bv, then reserved
_MAGIC1 = 0x46505853  # FP_XSTATE_MAGIC1, first of the software-reserved bytes at 464
_MAGIC2 = 0x46505845  # FP_XSTATE_MAGIC2, the 4 bytes right after the image
_MAGIC2_BYTES = 4
UC_FP_XSTATE = 0x1  # uc_flags: the frame's FPU state is an XSAVE image


def _enabled_features(image: bytes) -> int:
    """XCR0, which ptrace writes first in the image's software-reserved bytes (where
    a signal frame has its ``struct _fpx_sw_bytes``)."""
    return int(struct.unpack_from("<Q", image, 464)[0])


def usable(image: bytes | None) -> bool:
    """``image`` is a standard-format XSAVE image the kernel can restore whole."""
    if image is None or len(image) < _FXSAVE_BYTES + _HEADER_BYTES or len(image) % 64:
        return False
    features = _enabled_features(image)
    xstate_bv, xcomp_bv = struct.unpack_from("<QQ", image, _FXSAVE_BYTES)
    reserved = image[_FXSAVE_BYTES + 16:_FXSAVE_BYTES + _HEADER_BYTES]
    # x87 and SSE enabled, no compaction bit, nothing the kernel would refuse
    return (features & 3 == 3 and xcomp_bv == 0 and not any(reserved)
            and xstate_bv & ~features == 0)


def frame_state(image: bytes | None, fxsave: bytes) -> tuple[bytes, int]:
    """What goes at the frame's 64-byte aligned FPU state pointer, and the uc_flags
    bit that says which it is: the XSAVE image with the software bytes and closing
    magic of a signal frame, or the FXSAVE image without any XSAVE marker (x87, SSE
    and MXCSR come back as they were)."""
    if image is not None and usable(image):
        software = struct.pack("<IIQI", _MAGIC1, len(image) + _MAGIC2_BYTES,
                               _enabled_features(image), len(image))
        software += bytes(48 - len(software))
        return (image[:464] + software + image[_FXSAVE_BYTES:]
                + struct.pack("<I", _MAGIC2)), UC_FP_XSTATE
    return fxsave[:464] + bytes(48), 0


def frame_state_bytes(image: bytes | None) -> int:
    """The most bytes ``frame_state`` can give for ``image``."""
    return (len(image) + _MAGIC2_BYTES) if image is not None and usable(image) \
        else _FXSAVE_BYTES


# struct user_regs_struct, in order
REGISTERS = ("r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax",
             "rcx", "rdx", "rsi", "rdi", "orig_rax", "rip", "cs", "eflags", "rsp", "ss",
             "fs_base", "gs_base", "ds", "es", "fs", "gs")
_ERESTART_CODES = (-512, -513, -514)  # ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND


def signed(register: int) -> int:
    return register - (1 << 64) if register >= 1 << 63 else register


def signal_frame(at: int, regs: list[int], fxsave: bytes, blocked: int, gadget: int, *,
                  interrupt: bool = False, xstate: bytes | None = None) -> bytes:
    """What the borrowed thread finds on its stack at ``at`` when the called function
    returns: the address of an rt_sigreturn, then the frame that call restores, which is
    the thread as we stopped it, its interrupted system call set to run again; or, with
    ``interrupt``, to return EINTR, as after a signal handler without SA_RESTART. Its
    FPU state is ``xstate``, the whole XSAVE image, where usable, else ``fxsave``."""
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
    state, fp_flag = frame_state(xstate, fxsave)
    # uc_flags UC_SIGCONTEXT_SS | UC_STRICT_RESTORE_SS (and UC_FP_XSTATE with the XSAVE
    # image); uc_stack with an invalid ss_flags, so the kernel keeps the thread's signal
    # stack as it is (it ignores that error).
    ucontext = struct.pack("<QQQiiQ", 6 | fp_flag, 0, 0, 0x10, 0, 0) + context + struct.pack(
        "<Q", blocked)
    frame = struct.pack("<Q", gadget) + ucontext
    return frame + bytes(fx_at - at - len(frame)) + state
