"""PEP 768's remote exec from an agent whose Python is not the job's: the debug
offsets read from bytes laid out as CPython 3.14's header says, which injector a 3.14
job gets (a main thread in a lock wait: the ptrace injector's), and the reach table's
sections for jobs run in a Debian root. Real 3.14 jobs: test_remote_debug_roots.py."""

from __future__ import annotations

import platform
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import reach
from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import InjectionNotNow, UnknownDebugOffsets
from dlprof_agent.reach import debug_offsets
from dlprof_agent.reach import inject as injector
from dlprof_agent.reach.call_plan import CallAddresses
from dlprof_agent.reach.debug_offsets import parse_debug_offsets
from dlprof_agent.reach.lock_wait import ParkingLotWait
from dlprof_agent.reach.runtime import PythonRuntime

VERSION_3_14 = 0x030E0AF0  # PY_VERSION_HEX of 3.14.10, a final release


def _table(version_hex: int = VERSION_3_14, cookie: bytes = b"xdebugpy") -> bytes:
    """A 3.14 _Py_DebugOffsets (Include/internal/pycore_debug_offsets.h, 3.14): the
    cookie, the version, free_threaded, then 92 uint64_t fields, here each 1000 plus
    its word's index so that a field read from the wrong word shows."""
    words = [1000 + index for index in range(3, 95)]
    return cookie + struct.pack("<QQ", version_hex, 0) + struct.pack("<92Q", *words)


def test_the_3_14_table_is_95_words() -> None:
    # 3 header words and 19 sections of 3+16+9+8+11+2+4+3+3+4+3+2+3+3+4+2+4+2+6 words
    assert debug_offsets.TABLE_BYTES[(3, 14)] == 95 * 8


def test_the_fields_of_a_3_14_table() -> None:
    offsets = parse_debug_offsets(_table())
    assert offsets.version == (3, 14)
    assert not offsets.free_threaded
    # runtime_state starts at word 3: interpreters_head is its third field
    assert offsets.interpreters_head == 1005
    # interpreter_state starts at word 6: threads_main is its fifth field
    assert offsets.threads_main == 1010
    # thread_state starts at word 22: native_thread_id is its seventh field
    assert offsets.native_thread_id == 1028
    # debugger_support is the last section, words 89-94, after llist_node (87-88)
    assert (offsets.eval_breaker, offsets.remote_debugger_support,
            offsets.remote_debugging_enabled, offsets.debugger_pending_call,
            offsets.debugger_script_path, offsets.debugger_script_path_size) == (
        1089, 1090, 1091, 1092, 1093, 1094)


@pytest.mark.parametrize(("raw", "says"), [
    (_table(cookie=b"notdebug"), "cookie"),
    (_table(version_hex=0x030D05F0), "python 3.13"),  # 3.13's layout is another
    (_table(version_hex=0x030F00F0), "python 3.15"),
    (_table(version_hex=0x030E00B3), "pre-release"),  # 3.14.0b3
    (_table()[:400], "cut short"),
    (b"xdebugpy", "cookie"),
])
def test_tables_that_are_not_read(raw: bytes, says: str) -> None:
    with pytest.raises(UnknownDebugOffsets, match=says):
        parse_debug_offsets(raw)


def test_a_root_section_replaces_that_roots_old_one() -> None:
    old = reach.root_section([reach.Row("main in join()", False, 30.0, 3, "no")], 30.0,
                             Path("roots/sid"), "3.14.1")
    new = reach.root_section([reach.Row("main in join()", True, 0.3, 1)], 30.0,
                             Path("roots/sid"), "3.14.1")
    other = reach.root_section([reach.Row("main in join()", True, 0.2, 1)], 30.0,
                               Path("roots/trixie"), "3.13.5")
    text = reach.with_root_section("# Table\n\n## Notes\n\n- a note\n", old)
    text = reach.with_root_section(reach.with_root_section(text, other), new)
    assert text.count("## In a Debian root: sid") == 1
    assert "| main in join() | yes | 0.3 | 1 |  |" in text
    assert "| main in join() | no |" not in text
    assert "## In a Debian root: trixie" in text and "- a note" in text


def test_a_run_of_a_few_kinds_updates_their_rows_in_place_and_keeps_the_others() -> None:
    loop, join = "pure-Python loop, one thread", "main in join()"
    trixie = reach.root_section([reach.Row(loop, False, 36.3, 3, "no safe point"),
                                 reach.Row(join, True, 0.3, 1)], 30.0, Path("roots/trixie"),
                                "3.13.5")
    sid = reach.root_section([reach.Row(join, True, 0.1, 1)], 30.0, Path("roots/sid"),
                             "3.14.1")
    text = reach.with_root_section(reach.with_root_section("# Table\n", trixie), sid)
    update = reach.root_section([reach.Row(loop, True, 1.8, 1)], 30.0, Path("roots/trixie"),
                                "3.13.6")
    text = reach.with_root_section(text, update)
    assert text.count("## In a Debian root: trixie") == 1 and "trixie, Python 3.13.6" in text
    assert text.index("## In a Debian root: trixie") < text.index("## In a Debian root: sid")
    trixie_part = text[:text.index("## In a Debian root: sid")]
    assert trixie_part.endswith("|  |\n\n")  # a blank line before the next section
    assert trixie_part.index(f"| {loop} | yes | 1.8 | 1 |  |") < trixie_part.index(
        f"| {join} | yes | 0.3 | 1 |  |")  # the order of the kinds, the row kept
    assert "no safe point" not in text and f"| {join} | yes | 0.1 | 1 |  |" in text


@pytest.mark.parametrize(("parked", "opted_out", "ptrace_says", "used"), [
    (True, None, None, "ptrace"),  # a main thread in a lock wait: pending call + EINTR
    (False, None, None, "remote_debug"),  # any other 3.14 job: PEP 768's script
    (True, "opted out", None, "remote_debug"),  # which then refuses, saying why
    (True, None, InjectionNotNow("no thread", "later"), "remote_debug"),  # wait returned
])
def test_which_injector_a_3_14_job_of_another_python_gets(
        monkeypatch: pytest.MonkeyPatch, parked: bool, opted_out: str | None,
        ptrace_says: InjectionNotNow | None, used: str) -> None:
    if hasattr(sys, "remote_exec"):
        pytest.skip("the agent runs 3.14 itself: sys.remote_exec is used")
    calls = CallAddresses(1, 2, 3, 4, ParkingLotWait((5, 6), (7, 8)))

    def ptrace(*_: object, **__: object) -> str:
        if ptrace_says is not None:
            raise ptrace_says
        return "ptrace"

    for name, value in {
            "find_python_runtime": lambda target: PythonRuntime("/usr/bin/python3.14", (3, 14)),
            "remove_stale_files": lambda target: None,
            "pending_bootstrap": lambda target: None,
            "find_remote_debug": lambda target, runtime: "table",
            "plan_calls": lambda target, runtime: calls,
            "main_thread_parked": lambda target, wait: parked,
            "opted_out": lambda target, table: opted_out,
            "inject_with_ptrace": ptrace,
            "inject_with_remote_debug": lambda *_: "remote_debug"}.items():
        monkeypatch.setattr(injector, name, value)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    # A real process for the Target; every step that would touch it is replaced.
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        result: object = injector.inject(Target.of(job.pid), "pass")
    finally:
        job.kill()
        job.wait()
    assert result == used
