"""The reach table's measurement (``benchmarks/reach.py``) on the kinds of job it
must reach quickly: a main thread in a lock wait comes up on the first try,
within the wait; one in a sleep comes up once the sleep returns."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import reach
from tests.helpers import NO_OWN_INJECTOR, OWN_INJECTOR

pytestmark = [
    pytest.mark.slow,  # real jobs, probes injected into them
    pytest.mark.skipif(not OWN_INJECTOR, reason=NO_OWN_INJECTOR),
]


# Each beside a worker thread that trains in Python: the pending call must be queued
# from the main thread itself, whose timed wait goes on as restart_syscall once stopped.
@pytest.mark.parametrize("kind", ["main in join()", "main in lock.acquire()",
                                  "main in Event.wait(timeout)", "main in queue.get()",
                                  "main in time.sleep(6) in a loop"])
def test_a_waiting_main_thread_is_reached(kind: str) -> None:
    row = reach.measure(kind, limit=60.0)
    assert row.came_up, row.why
    assert row.tries == 1, f"reached by the first injection, not after: {row.why}"


def test_the_table_lists_each_row() -> None:
    rows = [reach.Row("main in join()", True, 0.4, 1),
            reach.Row("pure-Python loop, one thread", False, 30.0, 3, "no safe | point")]
    text = reach.table(rows, 30.0)
    assert "| main in join() | yes | 0.4 | 1 |  |" in text
    assert "| pure-Python loop, one thread | no | 30.0 | 3 | no safe / point |" in text


def test_a_run_on_the_agents_python_keeps_the_roots_sections(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "reach.md"
    section = reach.root_section([reach.Row("main in join()", False, 30.0, 4, "gdb")], 30.0,
                                 Path("roots/trixie"), "3.13.5")
    out.write_text(reach.with_root_section("# the old table\n", section))
    monkeypatch.setattr(reach, "measure",
                        lambda kind, limit: reach.Row(kind, True, 0.1, 1))
    assert reach.main(["--out", str(out), "main in join()"]) == 0
    text = out.read_text()
    assert "# the old table" not in text
    assert "| main in join() | yes | 0.1 | 1 |  |" in text
    assert text.endswith(section)
