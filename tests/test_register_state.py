"""A thread the ptrace injector borrows gets back every register it had: AVX-512's
zmm0-31 and k0-k7, and AMX's tiles where the CPU has them. The job (machine code,
so that no compiler decides what lives in which register) loads known bytes into
all of them, waits, and stores them back for the test to compare: once waiting in
a read() (the borrowed waiting thread), once spinning in a file-backed mapping
with no thread in a system call (the busy main thread stopped at a safe PC, see
``reach/safe_point.py``). The frame alone must restore them, not the agent's check
after it (``register_state.put_back``): that check is gone when the agent dies
during the detour, so a fix it makes fails the test too."""

from __future__ import annotations

import logging
import os
import platform
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dlprof_agent.collectors.target import Target
from dlprof_agent.reach.inject import inject
from tests.helpers import wait_until


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines()
                 if line.startswith("flags")), set())


CPU_FLAGS = _cpu_flags()
needs_ptrace_injector = pytest.mark.skipif(
    hasattr(sys, "remote_exec") or platform.machine() != "x86_64",
    reason="the agent's own ptrace injector: x86-64, before Python 3.14")
needs_avx512 = pytest.mark.skipif(
    not {"avx512f", "avx512bw"} <= CPU_FLAGS,
    reason="this CPU has no AVX-512 (avx512f, and avx512bw for 64-bit k registers)")
needs_amx = pytest.mark.skipif(
    "amx_tile" not in CPU_FLAGS,
    reason="this CPU has no AMX (amx_tile): the tile test needs Sapphire Rapids or later, "
           "and was written on a machine that could not run it")

# Where the job's machine code takes each register from, and puts it back
K_AT, ZMM_AT, TILECFG_AT, TILES_AT = 0, 64, 2112, 2176
TILE_BYTES = 16 * 64  # palette 1's largest tile: 16 rows of 64 bytes
VECTOR_BYTES, TILE_STATE_BYTES = TILECFG_AT, TILES_AT + 8 * TILE_BYTES

HOLD_ASSEMBLY = r"""
    .intel_syntax noprefix
# long hold(int fd, char *byte, const char *values, char *found, char *flag, long tiles)
# values and found: k0-k7 at 0, zmm0-31 at 64, TILECFG at 2112, tmm0-7 at 2176
    .set ZMM, 64
    .set TILECFG, 2112
    .set TILES, 2176
    test r9, r9                     # AMX only when asked: elsewhere it is #UD
    jz 1f
    mov eax, 64                     # row stride: each tile 16 rows of 64 bytes
    ldtilecfg [rdx + TILECFG]
    .irp n, 0,1,2,3,4,5,6,7
    tileloadd tmm\n, [rdx + rax*1 + TILES + \n*1024]
    .endr
1:  .irp n, 0,1,2,3,4,5,6,7
    kmovq k\n, [rdx + \n*8]
    .endr
    .irp n, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31
    vmovdqu64 zmm\n, [rdx + ZMM + \n*64]
    .endr
    mov r10, rcx                    # found: syscall clobbers rcx and r11
    test r8, r8
    jnz 2f
    xor eax, eax                    # read(fd, byte, 1)
    mov edx, 1
    syscall
    jmp 4f
2:  mov byte ptr [r8 + 1], 1        # tell the test that the values are in place
    rdtsc                           # and spin until flag[0] is set, or 2**36 TSC ticks
    shl rdx, 32
    lea r11, [rax + rdx]
    mov eax, 1
    shl rax, 36
    add r11, rax
3:  pause
    mov eax, 1                      # returns 1: the flag was set
    cmp byte ptr [r8], 0
    jne 4f
    rdtsc
    shl rdx, 32
    or rax, rdx
    cmp rax, r11
    jb 3b
    xor eax, eax                    # returns 0: gave up waiting
4:  .irp n, 0,1,2,3,4,5,6,7
    kmovq [r10 + \n*8], k\n
    .endr
    .irp n, 0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31
    vmovdqu64 [r10 + ZMM + \n*64], zmm\n
    .endr
    test r9, r9
    jz 5f
    sttilecfg [r10 + TILECFG]
    cmp byte ptr [r10 + TILECFG], 0  # palette 0: the tiles were reset, and unusable
    je 5f
    mov edx, 64
    .irp n, 0,1,2,3,4,5,6,7
    tilestored [r10 + rdx*1 + TILES + \n*1024], tmm\n
    .endr
    tilerelease
5:  vzeroupper
    ret
"""
# HOLD_ASSEMBLY as GNU as (binutils 2.40) assembles it; test_the_machine_code_is_its_assembly
# prints the new bytes when the two part.
HOLD = bytes.fromhex(
    "4d85c9745eb840000000c4e278498240080000c4e27b4b840280080000c4e27b4b8c02800c0000c4e27b4b94"
    "0280100000c4e27b4b9c0280140000c4e27b4ba40280180000c4e27b4bac02801c0000c4e27b4bb402802000"
    "00c4e27b4bbc0280240000c4e1f89002c4e1f8904a08c4e1f8905210c4e1f8905a18c4e1f8906220c4e1f890"
    "6a28c4e1f8907230c4e1f8907a3862f1fe486f420162f1fe486f4a0262f1fe486f520362f1fe486f5a0462f1"
    "fe486f620562f1fe486f6a0662f1fe486f720762f1fe486f7a086271fe486f42096271fe486f4a0a6271fe48"
    "6f520b6271fe486f5a0c6271fe486f620d6271fe486f6a0e6271fe486f720f6271fe486f7a1062e1fe486f42"
    "1162e1fe486f4a1262e1fe486f521362e1fe486f5a1462e1fe486f621562e1fe486f6a1662e1fe486f721762"
    "e1fe486f7a186261fe486f42196261fe486f4a1a6261fe486f521b6261fe486f5a1c6261fe486f621d6261fe"
    "486f6a1e6261fe486f721f6261fe486f7a204989ca4d85c0750b31c0ba010000000f05eb3841c64001010f31"
    "48c1e2204c8d1c10b80100000048c1e0244901c3f390b8010000004180380075100f3148c1e2204809d04c39"
    "d872e531c0c4c1f89102c4c1f8914a08c4c1f8915210c4c1f8915a18c4c1f8916220c4c1f8916a28c4c1f891"
    "7230c4c1f8917a3862d1fe487f420162d1fe487f4a0262d1fe487f520362d1fe487f5a0462d1fe487f620562"
    "d1fe487f6a0662d1fe487f720762d1fe487f7a086251fe487f42096251fe487f4a0a6251fe487f520b6251fe"
    "487f5a0c6251fe487f620d6251fe487f6a0e6251fe487f720f6251fe487f7a1062c1fe487f421162c1fe487f"
    "4a1262c1fe487f521362c1fe487f5a1462c1fe487f621562c1fe487f6a1662c1fe487f721762c1fe487f7a18"
    "6241fe487f42196241fe487f4a1a6241fe487f521b6241fe487f5a1c6241fe487f621d6241fe487f6a1e6241"
    "fe487f721f6241fe487f7a204d85c9746dc4c2794982400800004180ba4008000000745aba40000000c4c27a"
    "4b841280080000c4c27a4b8c12800c0000c4c27a4b941280100000c4c27a4b9c1280140000c4c27a4ba41280"
    "180000c4c27a4bac12801c0000c4c27a4bb41280200000c4c27a4bbc1280240000c4e27849c0c5f877c3")

# Runs HOLD from a file mapped as a library's code is (r-x, file-backed: a busy thread
# stopped there is at a safe PC) on the values in ./values, leaves the registers it got
# back in ./found, and prints what HOLD returned. argv[1]: read (wait in a read of
# stdin), spin (spin on the shared page ./flag) or tiles (read, with AMX tiles too);
# arm64's HOLD (test_register_state_arm64.py) takes sve (spin, with SVE registers).
JOB = """
import ctypes, mmap, os, sys
mode = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long)

def mapped(name, prot, flags):
    fd = os.open(name, os.O_RDWR)
    address = libc.mmap(None, os.fstat(fd).st_size, prot, flags, fd, 0)
    os.close(fd)
    if address in (None, 2**64 - 1):
        sys.exit(f"mmap of {name}: errno {ctypes.get_errno()}")
    return address

# arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): without it a tile load is SIGILL
if mode == "tiles" and libc.syscall(ctypes.c_long(158), ctypes.c_long(0x1023),
                                    ctypes.c_long(18)):
    sys.exit(f"the kernel refused AMX: errno {ctypes.get_errno()}")
hold = ctypes.CFUNCTYPE(ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p,
                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long)(
    mapped("hold.bin", mmap.PROT_READ | mmap.PROT_EXEC, mmap.MAP_PRIVATE))
flag = (mapped("flag", mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED)
        if mode in ("spin", "sve") else None)
values = open("values", "rb").read()
found = ctypes.create_string_buffer(len(values))
print("ready", flush=True)
returned = hold(0, ctypes.create_string_buffer(1), values, found, flag,
                mode in ("tiles", "sve"))
open("found", "wb").write(found.raw)
print(returned, flush=True)
"""


def held_values(*, tiles: bool) -> bytes:
    """What the job holds: bytes of a fixed seed in k0-k7 and zmm0-31 (a register the
    kernel resets reads zero, which they are not); with ``tiles``, a palette 1
    configuration of eight 16x64-byte tiles, and their bytes."""
    seeded = random.Random(0x2E7)
    vectors = seeded.randbytes(VECTOR_BYTES)
    if not tiles:
        return vectors
    config = bytearray(64)
    config[0] = 1  # palette 1; start_row and the reserved bytes 0
    for tile in range(8):
        config[16 + 2 * tile:18 + 2 * tile] = (64).to_bytes(2, "little")  # colsb
        config[48 + tile] = 16  # rows
    return vectors + bytes(config) + seeded.randbytes(8 * TILE_BYTES)


def lost_registers(values: bytes, found: bytes) -> list[str]:
    """The registers that came back different: each k register; each zmm register
    whole, or the bits of it that differ in 128-bit steps (an FXSAVE frame keeps bits
    0-127 of zmm0-15); TILECFG and each tile."""
    def differ(at: int, size: int) -> bool:
        return found[at:at + size] != values[at:at + size]

    lost = [f"k{n}" for n in range(8) if differ(K_AT + 8 * n, 8)]
    for n in range(32):
        spans: list[list[int]] = []
        for bit in range(0, 512, 128):
            if differ(ZMM_AT + 64 * n + bit // 8, 16):
                if spans and spans[-1][1] == bit:
                    spans[-1][1] = bit + 128
                else:
                    spans.append([bit, bit + 128])
        if spans == [[0, 512]]:
            lost.append(f"zmm{n}")
        elif spans:
            lost.append(f"zmm{n}[" + ",".join(f"{low}:{high}" for low, high in spans) + "]")
    if len(values) > TILECFG_AT:
        if differ(TILECFG_AT, 64):
            lost.append("tilecfg")
        lost += [f"tmm{n}" for n in range(8) if differ(TILES_AT + TILE_BYTES * n, TILE_BYTES)]
    return lost


def start_job(directory: Path, mode: str, values: bytes, *, code: bytes = HOLD,
              script: str = JOB) -> subprocess.Popen[str]:
    """``script`` (JOB, or another CPU's) holding ``values`` with ``code`` (its HOLD)."""
    (directory / "hold.bin").write_bytes(code)
    (directory / "values").write_bytes(values)
    (directory / "flag").write_bytes(bytes(4096))
    job = subprocess.Popen([sys.executable, "-c", script, mode], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           cwd=directory)
    assert job.stdout is not None
    line = job.stdout.readline()
    if line != "ready\n":
        job.kill()
        pytest.fail(f"the job did not start: {line!r} {job.communicate(timeout=10)[1]}")
    return job


def finish(job: subprocess.Popen[str], stdin: str = "") -> str:
    """What the job printed last (HOLD's return), once it has exited."""
    out, err = job.communicate(stdin, timeout=120)
    assert job.returncode == 0, f"the job failed ({job.returncode}): {err}"
    return out.strip()


def stop(job: subprocess.Popen[str]) -> None:
    if job.poll() is None:
        job.kill()
    job.wait(10)


def put_back_by_the_agent(records: list[logging.LogRecord]) -> list[str]:
    """The injector's warnings that it had to put state back itself (the frame had
    lost it)."""
    return [record.getMessage() for record in records
            if "came back from its detour without" in record.getMessage()]


def check_nothing_lost(values: bytes, found: Path, records: list[logging.LogRecord]) -> None:
    lost = lost_registers(values, found.read_bytes())
    assert not lost, f"came back different: {' '.join(lost)}"
    fixed = put_back_by_the_agent(records)
    assert not fixed, f"the frame lost state that the agent put back: {fixed}"


def write_marker(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').write('ran')"


def borrowed_in_a_read(job: subprocess.Popen[str], marker: Path,
                       caplog: pytest.LogCaptureFixture, *, read_call: str = "0",
                       seconds: float = 10) -> str:
    """Inject into ``job`` once its only thread waits in its read (system call
    ``read_call``), then give the read its byte: what HOLD returned."""
    try:
        wait_until(lambda: Path(f"/proc/{job.pid}/syscall").read_text().split()[0] == read_call,
                   seconds, what="the job's read, its registers loaded")
        with caplog.at_level(logging.WARNING, logger="dlprof_agent"):
            inject(Target.of(job.pid), write_marker(marker))  # its only thread, in that read
        return finish(job, "x")
    finally:
        stop(job)


def borrowed_while_spinning(job: subprocess.Popen[str], flag: Path, marker: Path,
                            caplog: pytest.LogCaptureFixture, *, seconds: float = 10) -> str:
    """Inject into ``job`` while its only thread spins in HOLD, then set the flag that
    ends the spin: what HOLD returned."""
    try:
        wait_until(lambda: flag.read_bytes()[1] == 1, seconds,
                   what="the job's spin, its registers loaded")
        assert os.listdir(f"/proc/{job.pid}/task") == [str(job.pid)], \
            "a second thread could be borrowed instead of the busy one"
        with caplog.at_level(logging.WARNING, logger="dlprof_agent"):
            inject(Target.of(job.pid), write_marker(marker))
        with flag.open("r+b") as shared:
            shared.write(b"\1")
        return finish(job)
    finally:
        stop(job)


def check_registers_across_a_read(tmp_path: Path, caplog: pytest.LogCaptureFixture, *,
                                  tiles: bool) -> None:
    values = held_values(tiles=tiles)
    marker = tmp_path / "ran"
    job = start_job(tmp_path, "tiles" if tiles else "read", values)
    returned = borrowed_in_a_read(job, marker, caplog)
    assert returned == "1", "the read did not return its one byte"
    assert marker.exists(), "the injected code did not run"
    check_nothing_lost(values, tmp_path / "found", caplog.records)


@needs_ptrace_injector
@needs_avx512
def test_a_thread_borrowed_in_a_read_keeps_its_avx512_registers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    check_registers_across_a_read(tmp_path, caplog, tiles=False)


@needs_ptrace_injector
@needs_avx512
def test_a_busy_main_thread_borrowed_at_a_safe_pc_keeps_its_avx512_registers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The job's only thread spins in machine code mapped from a file, with no system
    call to be borrowed from: the injector stops it there. It spins until the test
    sets the flag, once the pending call is queued, then returns to Python, which runs
    that call."""
    values = held_values(tiles=False)
    marker = tmp_path / "ran"
    flag = tmp_path / "flag"
    job = start_job(tmp_path, "spin", values)
    returned = borrowed_while_spinning(job, flag, marker, caplog)
    assert returned == "1", "the spin gave up before the flag was set"
    assert marker.exists(), "the injected code did not run"
    check_nothing_lost(values, tmp_path / "found", caplog.records)


@needs_ptrace_injector
@needs_avx512
@needs_amx
def test_a_thread_borrowed_in_a_read_keeps_its_amx_tiles(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The thread uses AMX, so its frame is the large one, TILEDATA included (XFD)."""
    check_registers_across_a_read(tmp_path, caplog, tiles=True)


def test_the_machine_code_is_its_assembly(tmp_path: Path) -> None:
    tools = [shutil.which(name) for name in ("as", "objcopy")]
    if platform.machine() != "x86_64" or None in tools:
        pytest.skip("needs GNU as and objcopy for x86-64")
    assembler, objcopy = (str(tool) for tool in tools)
    knows_amx = subprocess.run([assembler, "-o", os.devnull], input="tilerelease\n",
                               capture_output=True, text=True, check=False)
    if knows_amx.returncode:
        pytest.skip(f"this assembler does not know AMX: {knows_amx.stderr.strip()}")
    (tmp_path / "hold.s").write_text(HOLD_ASSEMBLY)
    subprocess.run([assembler, "-o", "hold.o", "hold.s"], cwd=tmp_path, check=True)
    subprocess.run([objcopy, "-O", "binary", "-j", ".text", "hold.o", "hold.bin"],
                   cwd=tmp_path, check=True)
    assembled = (tmp_path / "hold.bin").read_bytes()
    assert assembled == HOLD, f"HOLD is not HOLD_ASSEMBLY; the bytes: {assembled.hex()}"


def test_lost_registers_are_named_by_what_an_fxsave_frame_loses() -> None:
    values = held_values(tiles=True)
    found = bytearray(values)
    found[K_AT + 8 * 3] ^= 1
    found[ZMM_AT + 64 * 2 + 16:ZMM_AT + 64 * 3] = bytes(48)  # bits 128-511
    found[ZMM_AT + 64 * 20:ZMM_AT + 64 * 21] = bytes(64)
    found[TILES_AT + TILE_BYTES * 7 + 5] ^= 1
    assert lost_registers(values, bytes(found)) == ["k3", "zmm2[128:512]", "zmm20", "tmm7"]
    assert lost_registers(values, values) == []
