"""A thread the ptrace injector borrows gets its AVX registers back whole: the
signal frame holds its XSAVE image cut to the thread's own layout
(``reach/frame.py``), and the agent checks what came back (``register_state``).
The job holds all-ones in the upper half of ymm2 across a blocking read (machine
code, so that no compiler decides what lives in which register), and tells what
it finds there after the read returns; with the FXSAVE image alone, that half
comes back zero. The layouts below are those CPUID gives on the CPUs named."""

from __future__ import annotations

import logging
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import InjectionUnsafe, StateNotKept
from dlprof_agent.reach import frame, register_state, x86_64
from dlprof_agent.reach.inject import inject
from dlprof_agent.reach.xsave_layout import (
    Component,
    LayoutUnknown,
    XsaveLayout,
    cpuid,
    host_layout,
)
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


def _job_in_its_read(tmp_path: Path) -> subprocess.Popen[str]:
    """The job, started, once its only thread waits in read()."""
    job = subprocess.Popen([sys.executable, "-c", JOB], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    assert job.stdout is not None and job.stdout.readline() == "ready\n"
    wait_until(lambda: Path(f"/proc/{job.pid}/syscall").read_text().split()[0] == "0",
               10, what="the job's read")
    return job


def _upper_half_after_a_borrow(tmp_path: Path) -> int:
    """Start the job, borrow its only thread while it waits in read(), and return the
    low 64 bits of ymm2's upper half as the job found them after the read."""
    marker = tmp_path / "ran"
    job = _job_in_its_read(tmp_path)
    try:
        assert job.stdout is not None and job.stdin is not None
        inject(Target.of(job.pid), f"open({str(marker)!r}, 'w').write('ran')")  # its only thread
        job.stdin.write("x")
        job.stdin.flush()
        upper = int(job.stdout.readline())
        wait_until(marker.exists, 10)
    finally:
        job.kill()
        job.wait(10)
    return upper


def _fxsave_frame(image: bytes | None, fxsave: bytes, layout: object = None
                  ) -> tuple[bytes, int]:
    """The frame an AMX host's kernel restored from an image too large for the thread:
    x87 and SSE only."""
    return fxsave[:464] + bytes(48), 0


@needs_ptrace_injector
@needs_avx
def test_a_borrowed_thread_keeps_its_avx_registers(tmp_path: Path) -> None:
    assert _upper_half_after_a_borrow(tmp_path) == -1, \
        "the upper half of ymm2 was lost on the way back"


@needs_ptrace_injector
@needs_avx
def test_state_the_frame_lost_is_put_back_through_ptrace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    monkeypatch.setattr(frame, "frame_state", _fxsave_frame)
    with caplog.at_level(logging.WARNING, logger="dlprof_agent"):
        assert _upper_half_after_a_borrow(tmp_path) == -1, "ptrace did not put it back"
    assert any("without its AVX" in record.getMessage() for record in caplog.records)


@needs_ptrace_injector
@needs_avx
def test_without_the_check_such_a_frame_loses_the_upper_halves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the two tests above guard against, shown on this CPU: the job sees it."""
    monkeypatch.setattr(frame, "frame_state", _fxsave_frame)
    monkeypatch.setattr(x86_64, "put_back", lambda *args: None)
    assert _upper_half_after_a_borrow(tmp_path) == 0


# A Sapphire Rapids layout (CPUID leaf 0xD there): AVX, AVX-512, PKRU, and AMX's
# TILECFG and TILEDATA, the latter XFD-guarded; ptrace's image is 11008 bytes.
SAPPHIRE_RAPIDS = XsaveLayout(0x602E7, {
    2: Component(576, 256, False), 5: Component(1088, 64, False),
    6: Component(1152, 512, False), 7: Component(1664, 1024, False),
    9: Component(2688, 8, False), 17: Component(2752, 64, False),
    18: Component(2816, 8192, True)})
AVX512_ONLY = XsaveLayout(0xE7, {
    2: Component(576, 256, False), 5: Component(1088, 64, False),
    6: Component(1152, 512, False), 7: Component(1664, 1024, False)})


def xsave_image(*, enabled: int = 0xE7, in_use: int = 0x7, size: int = 2688,
                compacted: bool = False) -> bytes:
    """A standard-format image as ptrace gives it: XCR0 first in the software bytes,
    every byte past the header set so that a cut shows."""
    legacy = bytes(range(160)) + bytes(304) + enabled.to_bytes(8, "little") + bytes(40)
    header = in_use.to_bytes(8, "little") + ((1 << 63) if compacted else 0).to_bytes(
        8, "little") + bytes(48)
    return legacy + header + b"\xa5" * (size - 576)


def software_bytes(state: bytes) -> tuple[int, int, int, int]:
    return tuple(int.from_bytes(state[at:at + width], "little")  # type: ignore[return-value]
                 for at, width in ((464, 4), (468, 4), (472, 8), (480, 4)))


def test_the_frame_carries_the_image_with_a_signal_frames_markers() -> None:
    state, flag = frame.frame_state(xsave_image(), bytes(512), AVX512_ONLY)
    assert flag == frame.UC_FP_XSTATE
    assert software_bytes(state) == (0x46505853, 2692, 0xE7, 2688)
    assert state[2688:] == (0x46505845).to_bytes(4, "little") and len(state) == 2692
    assert state[576:2688] == xsave_image()[576:]


def test_a_thread_without_amx_in_use_gets_a_frame_of_its_own_size() -> None:
    """The kernel restores a frame whole only up to the thread's own size: on an AMX
    CPU, ptrace's 11008-byte image in the frame lost AVX and AVX-512 (the failure)."""
    image = xsave_image(enabled=0x602E7, in_use=0x2E7, size=11008)
    state, flag = frame.frame_state(image, bytes(512), SAPPHIRE_RAPIDS)
    assert flag == frame.UC_FP_XSTATE
    assert software_bytes(state) == (0x46505853, 2816 + 4, 0x202E7, 2816)
    assert len(state) == 2820 and state[576:2816] == image[576:2816]


def test_a_thread_with_tiles_in_use_gets_them_in_its_frame() -> None:
    image = xsave_image(enabled=0x602E7, in_use=0x602E7, size=11008)
    state, _ = frame.frame_state(image, bytes(512), SAPPHIRE_RAPIDS)
    assert software_bytes(state) == (0x46505853, 11012, 0x602E7, 11008)
    assert state[576:11008] == image[576:]


@pytest.mark.parametrize(("image", "why"), [
    (None, "no XSAVE image"),
    (xsave_image(compacted=True), "not in the standard format"),
    (xsave_image(enabled=0x800E7), "does not place XSAVE APX"),
    (xsave_image(size=1024), "has 1024 bytes"),
], ids=["none", "compacted", "unknown component", "short"])
def test_state_the_frame_cannot_hold_is_refused(image: bytes | None, why: str) -> None:
    """Never a smaller frame in silence: the injector borrows nothing then."""
    with pytest.raises(StateNotKept, match=why):
        frame.frame_state(image, bytes(512), AVX512_ONLY)


def test_a_cpu_with_x87_and_sse_alone_gets_the_fxsave_frame() -> None:
    fxsave = bytes(range(256)) * 2
    state, flag = frame.frame_state(None, fxsave, XsaveLayout(0x3, {}))
    assert flag == 0 and state == fxsave[:464] + bytes(48)


def test_differences_are_named_by_component() -> None:
    saved = xsave_image(enabled=0x602E7, in_use=0x602E7, size=11008)
    restored = bytearray(saved)
    restored[600] ^= 1  # AVX
    restored[1100] ^= 1  # opmask
    restored[5000] ^= 1  # TILEDATA
    restored[512] ^= 4  # the header says how, not what: ignored
    lost = frame.state_differences(saved, bytes(restored), SAPPHIRE_RAPIDS)
    assert frame.component_names(lost) == "AVX, AVX-512 opmask, AMX TILEDATA"
    assert frame.state_differences(saved, saved, SAPPHIRE_RAPIDS) == 0


def test_the_host_layout_agrees_with_cpuid_s_own_total() -> None:
    """CPUID.(0xD,0).EBX is the size the enabled components need: the sum of the
    parts as read one by one must land on it."""
    if platform.machine() != "x86_64":
        pytest.skip("CPUID is an x86-64 instruction")
    layout = host_layout()
    if layout.xcr0 == 0x3:
        pytest.skip("the OS has not enabled XSAVE here")
    assert layout.size(layout.xcr0) == cpuid(0xD, 0)[1]


@needs_ptrace_injector
def test_an_unknown_layout_refuses_in_one_line_and_leaves_the_job_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def unknown() -> XsaveLayout:
        raise LayoutUnknown("cannot run CPUID in the agent (denied)")

    monkeypatch.setattr(register_state, "host_layout", unknown)
    job = _job_in_its_read(tmp_path)
    try:
        assert job.stdout is not None and job.stdin is not None
        with pytest.raises(InjectionUnsafe, match="XSAVE layout is unknown") as caught:
            inject(Target.of(job.pid), "pass")
        assert "\n" not in str(caught.value)
        job.stdin.write("x")
        job.stdin.flush()
        assert job.stdout.readline() == ("-1\n" if _has_avx() else "0\n")
        assert job.wait(10) == 0
    finally:
        job.kill()
