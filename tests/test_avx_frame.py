"""A thread the ptrace injector borrows gets its AVX registers back whole: the
signal frame holds its XSAVE image (``reach/frame.py``). The job holds all-ones
in the upper half of ymm2 across a blocking read (machine code, so that no
compiler decides what lives in which register), and tells what it finds there
after the read returns; with the FXSAVE image alone, that half comes back zero."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from dlprof_agent.reach import frame
from dlprof_agent.reach.inject import inject
from tests.helpers import wait_until


def _has_avx() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and " avx " in f"{line} " for line in text.splitlines())


needs_ptrace_injector = pytest.mark.skipif(
    hasattr(sys, "remote_exec") or platform.machine() != "x86_64",
    reason="the agent's own ptrace injector: x86-64, before Python 3.14")
needs_avx = pytest.mark.skipif(not _has_avx(), reason="this CPU has no AVX registers to keep")

# long f(int fd, void *buffer): vcmptrueps ymm2 (all ones); read(fd, buffer, 1) by a
# raw system call; return the low 64 bits of ymm2's upper half; vzeroupper; ret.
UPPER_HALF_ACROSS_A_READ = "c5ecc2d20f31c0ba010000000f05c4e37d19d001c4e1f97ec0c5f877c3"

JOB = f"""
import ctypes, mmap
code = bytes.fromhex({UPPER_HALF_ACROSS_A_READ!r})
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
address = ctypes.addressof(ctypes.c_char.from_buffer(page))
upper_half = ctypes.CFUNCTYPE(ctypes.c_long, ctypes.c_int, ctypes.c_void_p)(address)
buffer = ctypes.create_string_buffer(1)
print("ready", flush=True)
print(upper_half(0, buffer), flush=True)
"""


@needs_ptrace_injector
@needs_avx
@pytest.mark.parametrize("image", ["xsave", "fxsave only"])
def test_a_borrowed_thread_keeps_its_avx_registers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, image: str) -> None:
    if image == "fxsave only":
        monkeypatch.setattr(frame, "usable", lambda image: False)  # the frame before XSAVE
    marker = tmp_path / "ran"
    job = subprocess.Popen([sys.executable, "-c", JOB], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        assert job.stdout is not None and job.stdin is not None
        assert job.stdout.readline() == "ready\n"
        wait_until(lambda: Path(f"/proc/{job.pid}/syscall").read_text().split()[0] == "0",
                   10, what="the job's read")
        inject(job.pid, f"open({str(marker)!r}, 'w').write('ran')")  # its only thread
        job.stdin.write("x")
        job.stdin.flush()
        upper = int(job.stdout.readline())
        wait_until(marker.exists, 10)
    finally:
        job.kill()
        job.wait(10)
    if image == "xsave":
        assert upper == -1, "the upper half of ymm2 was lost on the way back"
    else:
        assert upper == 0, "the FXSAVE frame resets the upper halves (why XSAVE is used)"


def xsave_image(*, compacted: bool = False) -> bytes:
    """A standard-format image as ptrace gives it: XCR0 first in the software bytes."""
    legacy = bytes(464) + (0xE7).to_bytes(8, "little") + bytes(40)
    header = (0x7).to_bytes(8, "little") + ((1 << 63) if compacted else 0).to_bytes(
        8, "little") + bytes(48)
    return legacy + header + bytes(2432 - 576)


def test_the_frame_carries_the_image_with_a_signal_frames_markers() -> None:
    state, flag = frame.frame_state(xsave_image(), bytes(512))
    assert flag == frame.UC_FP_XSTATE
    magic1, extended, features, size = (int.from_bytes(state[at:at + width], "little")
                                        for at, width in ((464, 4), (468, 4), (472, 8),
                                                          (480, 4)))
    assert (magic1, extended, features, size) == (0x46505853, 2436, 0xE7, 2432)
    assert state[2432:] == (0x46505845).to_bytes(4, "little") and len(state) == 2436
    assert frame.frame_state_bytes(xsave_image()) == 2436


@pytest.mark.parametrize("image", [None, b"", xsave_image(compacted=True)],
                         ids=["none", "empty", "compacted"])
def test_an_image_the_kernel_could_refuse_gives_the_fxsave_frame(image: bytes | None) -> None:
    fxsave = bytes(range(256)) * 2
    state, flag = frame.frame_state(image, fxsave)
    assert flag == 0 and state == fxsave[:464] + bytes(48)
