"""This CPU's XSAVE layout, read from the CPU itself: XCR0 (``xgetbv``), and for each
enabled state component its offset and size in the standard format and whether it is
guarded by XFD (CPUID leaf 0xD, sub-leaf i: EAX size, EBX offset, ECX bit 2). Nothing
here is a constant of one CPU: AVX-512's three components, PKRU, AMX's TILECFG and
TILEDATA (and whatever a later CPU adds) sit where CPUID says.

The injector needs it to write a signal frame the kernel restores whole. The kernel
restores a frame's XSAVE image only when the size it claims is at most the thread's
own signal-frame size (``fpstate->user_size``, ``check_xstate_in_sigframe`` in
``arch/x86/kernel/fpu/signal.c``), else it restores x87 and SSE alone and resets the
rest. ptrace's image is the largest the CPU has (``fpu_user_cfg.max_size``, AMX's
TILEDATA included), while a thread that never used AMX has the default size, without
the XFD-guarded components: on an AMX CPU that image, used as is, loses every AVX and
AVX-512 register. ``frame_size`` gives the thread's own size instead.

CPUID and XGETBV are run from a page of machine code in the agent (two instructions
each). The job runs on the same CPU, so the layout is the job's too.
"""

from __future__ import annotations

import functools
import mmap
import platform
import struct
from typing import NamedTuple

from dlprof_agent import errors

LEGACY_BYTES = 512  # the FXSAVE region: x87, MXCSR, XMM0-15
HEADER_BYTES = 64  # XSTATE_BV, XCOMP_BV, reserved
X87_SSE = 0b11  # components 0 and 1, always in the legacy region
_XSAVE_LEAF = 0xD
_XFD_BIT = 1 << 2  # CPUID.(0xD, i).ECX[2]: component i may be disabled by XFD

# void cpuid(uint32 leaf, uint32 subleaf, uint32 out[4]): push rbx; mov r8,rdx;
# mov eax,edi; mov ecx,esi; cpuid; mov [r8],eax; mov [r8+4],ebx; mov [r8+8],ecx;
# mov [r8+12],edx; pop rbx; ret
_CPUID_CODE = bytes.fromhex("534989d089f889f10fa2418900418958044189480841895" "00c5bc3")
# uint64 xgetbv(uint32 register): mov ecx,edi; xgetbv; shl rdx,32; or rax,rdx; ret
_XGETBV_CODE = bytes.fromhex("89f90f01d048c1e2204809d0c3")


class Component(NamedTuple):
    offset: int  # in the standard (uncompacted) format
    size: int
    xfd: bool  # disabled until the thread first uses it (AMX's TILEDATA)


class XsaveLayout(NamedTuple):
    xcr0: int  # the user state components the OS enabled
    components: dict[int, Component]  # each enabled component from 2 up

    @property
    def dynamic(self) -> int:
        """Components a thread gets only on first use (XFD), as a mask."""
        return sum(1 << index for index, part in self.components.items() if part.xfd)

    def size(self, features: int) -> int:
        """Bytes of a standard-format image holding ``features``."""
        return max([LEGACY_BYTES + HEADER_BYTES] + [
            part.offset + part.size for index, part in self.components.items()
            if features >> index & 1])

    def thread_features(self, xstate_bv: int) -> int:
        """The components a thread's signal frame holds, given its image's XSTATE_BV:
        every enabled one, but an XFD-guarded one only where the thread has it in use
        (then the kernel gave it the larger buffer)."""
        return self.xcr0 & ~self.dynamic | xstate_bv & self.dynamic

    def unknown(self, features: int) -> int:
        """The bits of ``features`` this layout cannot place."""
        return features & ~(X87_SSE | sum(1 << index for index in self.components))


class LayoutUnknown(errors.DlprofError):
    """The CPU's layout could not be read here; the message says why."""


@functools.cache
def _machine_code() -> tuple[object, object, mmap.mmap]:
    import ctypes

    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE
                     | mmap.PROT_EXEC)
    page.write(_CPUID_CODE + _XGETBV_CODE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    cpuid = ctypes.CFUNCTYPE(None, ctypes.c_uint32, ctypes.c_uint32,
                             ctypes.POINTER(ctypes.c_uint32))(address)
    xgetbv = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_uint32)(address + len(_CPUID_CODE))
    return cpuid, xgetbv, page  # the page lives as long as the functions


def cpuid(leaf: int, subleaf: int = 0) -> tuple[int, int, int, int]:
    """EAX, EBX, ECX, EDX of CPUID(leaf, subleaf). Raises LayoutUnknown off x86-64 or
    where the agent may not run a page of its own code (an execmem policy)."""
    import ctypes

    if platform.machine() != "x86_64":
        raise LayoutUnknown(f"CPUID is an x86-64 instruction, this is {platform.machine()}")
    try:
        function, _, _ = _machine_code()
    except (OSError, ValueError) as error:
        raise LayoutUnknown(f"cannot run CPUID in the agent ({error})") from None
    out = (ctypes.c_uint32 * 4)()
    function(leaf, subleaf, out)  # type: ignore[operator]
    return out[0], out[1], out[2], out[3]


@functools.cache
def host_layout() -> XsaveLayout:
    """This CPU's layout; where the OS has not enabled XSAVE, x87 and SSE alone (all
    FXSAVE holds). Raises LayoutUnknown where it cannot be read."""
    if not cpuid(1)[2] >> 27 & 1:  # CPUID.1:ECX.OSXSAVE
        return XsaveLayout(X87_SSE, {})
    _, xgetbv, _ = _machine_code()
    xcr0 = int(xgetbv(0))  # type: ignore[operator]
    components = {}
    for index in range(2, 64):
        if xcr0 >> index & 1:
            size, offset, flags, _ = cpuid(_XSAVE_LEAF, index)
            components[index] = Component(offset, size, bool(flags & _XFD_BIT))
    return XsaveLayout(xcr0, components)


def image_features(image: bytes) -> tuple[int, int]:
    """XCR0 as ptrace writes it in a standard-format image's software bytes, and the
    image's XSTATE_BV."""
    return (struct.unpack_from("<Q", image, 464)[0],
            struct.unpack_from("<Q", image, LEGACY_BYTES)[0])
