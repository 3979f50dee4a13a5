"""On arm64, a thread the ptrace injector borrows gets back every register it had:
V0-V31 (FP/SIMD) when borrowed in a read(), and Z0-Z31, P0-P15 and FFR at the thread's
SVE vector length when borrowed busy, stopped at a safe PC; with SME, ZA and TPIDR2
when borrowed in a read with ZA on. As on x86-64
(``test_register_state.py``), the job is machine code that loads known bytes into
them all, waits, and stores them back for the test to compare, and the frame alone
must restore them, not the agent's check after it. These run on an arm64 machine, or
in the emulated Grace guest (``scripts/arm64-check``, ``-cpu max``: SVE2, SME, PAC,
BTI); elsewhere only the assembly and the naming are checked."""

from __future__ import annotations

import ctypes
import logging
import platform
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import InjectionUnsafe
from dlprof_agent.reach.inject import inject
from tests.helpers import wait_until
from tests.test_inject_kill import status
from tests.test_register_state import (
    borrowed_in_a_read,
    borrowed_while_spinning,
    finish,
    put_back_by_the_agent,
    stop,
    write_marker,
)
from tests.test_register_state import start_job as start_holding_job

PR_SVE_GET_VL, PR_SVE_VL_LEN_MASK, PR_SME_GET_VL = 51, 0xFFFF, 64


def sve_vector_length() -> int | None:
    """This thread's SVE vector length in bytes (prctl PR_SVE_GET_VL); None without SVE."""
    if platform.machine() != "aarch64":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    got = libc.prctl(PR_SVE_GET_VL, 0, 0, 0, 0)
    return None if got < 0 else got & PR_SVE_VL_LEN_MASK


def sme_vector_length() -> int | None:
    """This thread's SME streaming vector length in bytes (prctl PR_SME_GET_VL); None
    without SME."""
    if platform.machine() != "aarch64":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    got = libc.prctl(PR_SME_GET_VL, 0, 0, 0, 0)
    return None if got < 0 else got & PR_SVE_VL_LEN_MASK


needs_arm64_injector = pytest.mark.skipif(
    hasattr(sys, "remote_exec") or platform.machine() != "aarch64",
    reason="the agent's own ptrace injector on arm64, before Python 3.14")
needs_sve = pytest.mark.skipif(sve_vector_length() is None, reason="this CPU has no SVE")
needs_sme = pytest.mark.skipif(sme_vector_length() is None, reason="this CPU has no SME")

V_AT, Z_AT = 0, 512

HOLD_ASSEMBLY = r"""
    .arch armv8.2-a+sve
// long hold(int fd, char *byte, const char *values, char *found, char *flag, long sve)
// values and found: v0-v31 at 0; with sve, z0-z31 at 512, then p0-p15, then FFR
    stp d8, d9, [sp, #-64]!          // callee-saved: the caller's, given back at the end
    stp d10, d11, [sp, #16]
    stp d12, d13, [sp, #32]
    stp d14, d15, [sp, #48]
    cbz x5, 1f
    add x6, x2, #512
    .irp n, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31
    ldr z\n, [x6, #\n, mul vl]
    .endr
    addvl x7, x6, #16
    addvl x7, x7, #16                // past z31: addvl takes at most 31
    ldr p0, [x7, #16, mul vl]        // FFR, through p0
    wrffr p0.b
    .irp n, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15
    ldr p\n, [x7, #\n, mul vl]
    .endr
    b 2f
1:
    ldp q0, q1, [x2, #0]
    ldp q2, q3, [x2, #32]
    ldp q4, q5, [x2, #64]
    ldp q6, q7, [x2, #96]
    ldp q8, q9, [x2, #128]
    ldp q10, q11, [x2, #160]
    ldp q12, q13, [x2, #192]
    ldp q14, q15, [x2, #224]
    ldp q16, q17, [x2, #256]
    ldp q18, q19, [x2, #288]
    ldp q20, q21, [x2, #320]
    ldp q22, q23, [x2, #352]
    ldp q24, q25, [x2, #384]
    ldp q26, q27, [x2, #416]
    ldp q28, q29, [x2, #448]
    ldp q30, q31, [x2, #480]
2:  mov x9, x3                       // found
    cbnz x4, 3f
    mov x8, #63                      // read(fd, byte, 1)
    mov x2, #1
    svc #0
    b 6f
3:  mov w10, #1
    strb w10, [x4, #1]               // tell the test that the values are in place
    movz x11, #0x10, lsl #32         // and spin until flag[0] is set, or 2**36 turns
4:  ldrb w10, [x4]
    cbnz w10, 5f
    subs x11, x11, #1
    b.ne 4b
    mov x0, #0                       // returns 0: gave up waiting
    b 6f
5:  mov x0, #1                       // returns 1: the flag was set
6:  cbz x5, 7f
    add x6, x9, #512
    .irp n, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31
    str z\n, [x6, #\n, mul vl]
    .endr
    addvl x7, x6, #16
    addvl x7, x7, #16                // past z31: addvl takes at most 31
    .irp n, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15
    str p\n, [x7, #\n, mul vl]
    .endr
    rdffr p0.b
    str p0, [x7, #16, mul vl]
    b 8f
7:
    stp q0, q1, [x9, #0]
    stp q2, q3, [x9, #32]
    stp q4, q5, [x9, #64]
    stp q6, q7, [x9, #96]
    stp q8, q9, [x9, #128]
    stp q10, q11, [x9, #160]
    stp q12, q13, [x9, #192]
    stp q14, q15, [x9, #224]
    stp q16, q17, [x9, #256]
    stp q18, q19, [x9, #288]
    stp q20, q21, [x9, #320]
    stp q22, q23, [x9, #352]
    stp q24, q25, [x9, #384]
    stp q26, q27, [x9, #416]
    stp q28, q29, [x9, #448]
    stp q30, q31, [x9, #480]
8:  ldp d14, d15, [sp, #48]
    ldp d12, d13, [sp, #32]
    ldp d10, d11, [sp, #16]
    ldp d8, d9, [sp], #64
    ret
"""
# HOLD_ASSEMBLY as GNU as (binutils 2.40) assembles it; test_the_machine_code_is_its_assembly
# prints the new bytes when the two part.
HOLD = bytes.fromhex(
    "e827bc6dea2f016dec37026dee3f036de50600b446000891c0408085c1448085c2488085c34c8085c4508085"
    "c5548085c6588085c75c8085c8408185c9448185ca488185cb4c8185cc508185cd548185ce588185cf5c8185"
    "d0408285d1448285d2488285d34c8285d4508285d5548285d6588285d75c8285d8408385d9448385da488385"
    "db4c8385dc508385dd548385de588385df5c83850752260407522704e000828500902825e0008085e1048085"
    "e2088085e30c8085e4108085e5148085e6188085e71c8085e8008185e9048185ea088185eb0c8185ec108185"
    "ed148185ee188185ef1c818511000014400440ad420c41ad441442ad461c43ad482444ad4a2c45ad4c3446ad"
    "4e3c47ad504448ad524c49ad54544aad565c4bad58644cad5a6c4dad5c744ead5e7c4fade90303aaa40000b5"
    "e80780d2220080d2010000d40b0000142a0080528a0400390b02c0d28a004039aa0000356b0500f1a1ffff54"
    "000080d202000014200080d2e50600b426010891c04080e5c14480e5c24880e5c34c80e5c45080e5c55480e5"
    "c65880e5c75c80e5c84081e5c94481e5ca4881e5cb4c81e5cc5081e5cd5481e5ce5881e5cf5c81e5d04082e5"
    "d14482e5d24882e5d34c82e5d45082e5d55482e5d65882e5d75c82e5d84083e5d94483e5da4883e5db4c83e5"
    "dc5083e5dd5483e5de5883e5df5c83e50752260407522704e00080e5e10480e5e20880e5e30c80e5e41080e5"
    "e51480e5e61880e5e71c80e5e80081e5e90481e5ea0881e5eb0c81e5ec1081e5ed1481e5ee1881e5ef1c81e5"
    "00f01925e00082e511000014200500ad220d01ad241502ad261d03ad282504ad2a2d05ad2c3506ad2e3d07ad"
    "304508ad324d09ad34550aad365d0bad38650cad3a6d0dad3c750ead3e7d0fadee3f436dec37426dea2f416d"
    "e827c46cc0035fd6")

HOLD_ZA_ASSEMBLY = r"""
    .arch armv9-a+sme
// long hold(int fd, char *byte, const char *values, char *found): ZA from values (its
// SVL rows of SVL bytes), then TPIDR2 from the 8 bytes after them; waits in
// read(fd, byte, 1); stores ZA and TPIDR2 to found the same way; returns read's result
    rdsvl x9, #1
    smstart za
    mov x10, x2
    mov w12, #0
1:  ldr za[w12, 0], [x10]
    add x10, x10, x9
    add w12, w12, #1
    cmp x12, x9
    b.ne 1b
    ldr x11, [x10]
    msr tpidr2_el0, x11
    mov x11, x3                      // found
    mov x8, #63                      // read(fd, byte, 1)
    mov x2, #1
    svc #0
    mov x13, x0
    mov x10, x11
    mov w12, #0
2:  str za[w12, 0], [x10]
    add x10, x10, x9
    add w12, w12, #1
    cmp x12, x9
    b.ne 2b
    mrs x11, tpidr2_el0
    str x11, [x10]
    msr tpidr2_el0, xzr              // no lazy save pending for the caller's code
    smstop za
    mov x0, x13
    ret
"""
# HOLD_ZA_ASSEMBLY as GNU as (binutils 2.40) assembles it
HOLD_ZA = bytes.fromhex(
    "2958bf047f4503d5ea0302aa0c008052400100e14a01098b8c0500119f0109eb81ffff544b0140f9abd01bd5"
    "eb0303aae80780d2220080d2010000d4ed0300aaea030baa0c008052400120e14a01098b8c0500119f0109eb"
    "81ffff54abd03bd54b0100f9bfd01bd57f4403d5e0030daac0035fd6")

SPIN_STREAMING_ASSEMBLY = r"""
    .arch armv9-a+sme
// long hold(int fd, char *byte, const char *values, char *found, char *flag, long sve):
// in SME streaming mode, sets flag[1] and spins until flag[0] is set (returns 1), or
// 2**36 turns (returns 0); leaves streaming mode before it returns
    smstart sm
    mov w10, #1
    strb w10, [x4, #1]
    movz x11, #0x10, lsl #32
1:  ldrb w10, [x4]
    cbnz w10, 2f
    subs x11, x11, #1
    b.ne 1b
    mov x0, #0
    b 3f
2:  mov x0, #1
3:  smstop sm
    ret
"""
# SPIN_STREAMING_ASSEMBLY as GNU as (binutils 2.40) assembles it
SPIN_STREAMING = bytes.fromhex(
    "7f4303d52a0080528a0400390b02c0d28a004039aa0000356b0500f1a1ffff54000080d202000014200080d2"
    "7f4203d5c0035fd6")


def held_values(vl: int | None) -> bytes:
    """What the job holds: bytes of a fixed seed in V0-V31; with ``vl``, in Z0-Z31 and
    P0-P15 too, and an FFR whose first half is set (FFR must be monotonic: set
    elements, then clear ones)."""
    seeded = random.Random(0xA64)
    values = seeded.randbytes(512)
    if vl is None:
        return values
    predicate = vl // 8
    return (values + seeded.randbytes(32 * vl) + seeded.randbytes(16 * predicate)
            + b"\xff" * (predicate // 2) + bytes(predicate - predicate // 2))


def lost_registers(values: bytes, found: bytes, vl: int | None) -> list[str]:
    """The registers that came back different, by name; a Z register whose low 128
    bits (its V register) came back but not the rest says ``zN[128:]``."""
    def differ(at: int, size: int) -> bool:
        return found[at:at + size] != values[at:at + size]

    if vl is None:
        return [f"v{n}" for n in range(32) if differ(V_AT + 16 * n, 16)]
    lost = []
    for n in range(32):
        at = Z_AT + vl * n
        if differ(at, 16):
            lost.append(f"z{n}")
        elif differ(at + 16, vl - 16):
            lost.append(f"z{n}[128:]")
    predicates = Z_AT + 32 * vl
    lost += [f"p{n}" for n in range(16) if differ(predicates + n * (vl // 8), vl // 8)]
    if differ(predicates + 16 * (vl // 8), vl // 8):
        lost.append("ffr")
    return lost


def start_job(directory: Path, mode: str, values: bytes) -> subprocess.Popen[str]:
    """test_register_state.py's job (read, spin, or sve: spin with SVE registers)
    running this HOLD."""
    return start_holding_job(directory, mode, values, code=HOLD)


def check(values: bytes, found: Path, vl: int | None,
          records: list[logging.LogRecord]) -> None:
    lost = lost_registers(values, found.read_bytes(), vl)
    assert not lost, f"came back different: {' '.join(lost)}"
    fixed = put_back_by_the_agent(records)
    assert not fixed, f"the frame lost state that the agent put back: {fixed}"


@needs_arm64_injector
def test_a_thread_borrowed_in_a_read_keeps_its_fp_simd_registers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    values = held_values(None)
    marker = tmp_path / "ran"
    job = start_job(tmp_path, "read", values)
    returned = borrowed_in_a_read(job, marker, caplog, read_call="63", seconds=30)
    assert returned == "1", "the read did not return its one byte"
    assert marker.exists(), "the injected code did not run"
    check(values, tmp_path / "found", None, caplog.records)


@needs_arm64_injector
@pytest.mark.parametrize("mode", ["spin", pytest.param("sve", marks=needs_sve)])
def test_a_busy_main_thread_borrowed_at_a_safe_pc_keeps_its_registers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: str) -> None:
    """The job's only thread spins in machine code mapped from a file, its V (spin) or
    SVE (sve) registers loaded, with no system call to be borrowed from: the injector
    stops it there, and the frame must carry its live SVE state at its vector length."""
    vl = sve_vector_length() if mode == "sve" else None
    values = held_values(vl)
    marker = tmp_path / "ran"
    flag = tmp_path / "flag"
    job = start_job(tmp_path, mode, values)
    returned = borrowed_while_spinning(job, flag, marker, caplog, seconds=30)
    assert returned == "1", "the spin gave up before the flag was set"
    assert marker.exists(), "the injected code did not run"
    check(values, tmp_path / "found", vl, caplog.records)


@needs_arm64_injector
@needs_sme
def test_a_thread_borrowed_in_a_read_with_za_on_keeps_za_and_tpidr2(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """SME: the thread has ZA on (``smstart za``), every row of it loaded, and TPIDR2
    set, and waits in a read. The frame holds no ZA record: the called functions never
    touch ZA or TPIDR2, so both must come back as they were by themselves, not put
    back by the agent after the detour."""
    svl = sme_vector_length()
    assert svl is not None
    seeded = random.Random(0x5AE)
    values = seeded.randbytes(svl * svl) + seeded.randbytes(8)  # ZA, then TPIDR2
    marker = tmp_path / "ran"
    job = start_holding_job(tmp_path, "read", values, code=HOLD_ZA)
    returned = borrowed_in_a_read(job, marker, caplog, read_call="63", seconds=30)
    assert returned == "1", "the read did not return its one byte"
    assert marker.exists(), "the injected code did not run"
    found = (tmp_path / "found").read_bytes()
    lost = [f"za row {row}" for row in range(svl)
            if found[row * svl:(row + 1) * svl] != values[row * svl:(row + 1) * svl]]
    lost += ["tpidr2"] if found[-8:] != values[-8:] else []
    assert not lost, f"came back different: {' '.join(lost)}"
    fixed = put_back_by_the_agent(caplog.records)
    assert not fixed, f"the frame lost state that the agent put back: {fixed}"


@needs_arm64_injector
@needs_sme
def test_a_busy_thread_in_streaming_mode_is_refused_in_one_line_and_runs_on(
        tmp_path: Path) -> None:
    """SME streaming mode: the called functions cannot run in it (much of A64's SIMD
    is illegal there), so such a thread is not borrowed. The refusal is one line,
    nothing runs in the job, and it goes on: stopped for the read of its state and
    let go, never left stopped or traced."""
    marker = tmp_path / "ran"
    flag = tmp_path / "flag"
    job = start_holding_job(tmp_path, "spin", bytes(8), code=SPIN_STREAMING)
    try:
        wait_until(lambda: flag.read_bytes()[1] == 1, 30, what="the job's spin in streaming mode")
        with pytest.raises(InjectionUnsafe) as refused:
            inject(Target.of(job.pid), write_marker(marker))
        said = str(refused.value)
        assert "SME streaming mode" in said and "\n" not in said, said
        assert status(job.pid, "TracerPid") == "0", "the job is left traced"
        with flag.open("r+b") as shared:
            shared.write(b"\1")
        assert finish(job) == "1", "the spin gave up before the flag was set"
        assert not marker.exists(), "code ran in a thread that was refused"
    finally:
        stop(job)


@pytest.mark.parametrize(("assembly", "code"), [(HOLD_ASSEMBLY, HOLD),
                                                 (HOLD_ZA_ASSEMBLY, HOLD_ZA),
                                                 (SPIN_STREAMING_ASSEMBLY, SPIN_STREAMING)],
                         ids=["hold", "hold_za", "spin_streaming"])
def test_the_machine_code_is_its_assembly(tmp_path: Path, assembly: str, code: bytes) -> None:
    prefix = "" if platform.machine() == "aarch64" else "aarch64-linux-gnu-"
    tools = [shutil.which(prefix + name) for name in ("as", "objcopy")]
    if None in tools:
        pytest.skip(f"needs GNU as and objcopy for arm64 ({prefix}as: binutils"
                    f"{'-aarch64-linux-gnu' if prefix else ''})")
    assembler, objcopy = (str(tool) for tool in tools)
    (tmp_path / "hold.s").write_text(assembly)
    subprocess.run([assembler, "-o", "hold.o", "hold.s"], cwd=tmp_path, check=True)
    subprocess.run([objcopy, "-O", "binary", "-j", ".text", "hold.o", "hold.bin"],
                   cwd=tmp_path, check=True)
    assembled = (tmp_path / "hold.bin").read_bytes()
    assert assembled == code, f"the code is not its assembly; the bytes: {assembled.hex()}"


def test_lost_registers_are_named_by_what_an_fpsimd_only_frame_loses() -> None:
    vl = 32
    values = held_values(vl)
    found = bytearray(values)
    found[Z_AT + 3 * vl + 16:Z_AT + 4 * vl] = bytes(vl - 16)  # z3 beyond its V register
    found[Z_AT + 32 * vl + 5 * 4] ^= 1  # p5
    assert lost_registers(values, bytes(found), vl) == ["z3[128:]", "p5"]
    assert lost_registers(values, values, vl) == []
    assert lost_registers(held_values(None), bytes(512), None) == [f"v{n}" for n in range(32)]
