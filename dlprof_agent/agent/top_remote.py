"""`top --url`: the same screen from any running agent's or daemon's /metrics,
read every interval; nothing is attached and nothing injected. Off a terminal it
prints the screen once, with rates over one interval."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from rich.console import Console

from dlprof_agent.agent.top_frame import build_frame, target_pids, target_rows
from dlprof_agent.agent.top_screen import TopScreen
from dlprof_agent.agent.top_view import ViewState, render, render_targets
from dlprof_agent.errors import DlprofError, ExitCode
from dlprof_agent.exporters.metrics_reader import MetricsUnreachable, MetricsUrl, Readings

PRINT_COLUMNS = 120
PRINT_LINES = 60


def _check_pid(readings: Readings, pid: int | None, url: str) -> None:
    pids = target_pids(readings)
    if pid is not None and pid not in pids:
        raise MetricsUnreachable(f"{url} has no target {pid}",
                                 "its targets: " + (", ".join(map(str, pids)) or "none"))


def watch_url(source: MetricsUrl, *, pid: int | None, interval: float,
              out: TextIO = sys.stdout, keyboard: TextIO = sys.stdin) -> int:
    """Show ``source``'s target ``pid`` (None: its only one, or a table to choose
    from) until q or Ctrl-C. Raises MetricsUnreachable before any screen when the
    first read fails."""
    url = source.metrics_url()
    first = source.read()
    _check_pid(first, pid, url)
    pids = target_pids(first)
    if pid is None and len(pids) == 1:
        pid = pids[0]
    if not (out.isatty() and keyboard.isatty()):
        return _print_once(source, first, pid, interval, out)
    latest = [first]
    screen = TopScreen(pid, lambda: latest[0], stream=out, keyboard=keyboard, source=url)
    stop = threading.Event()

    def fetch() -> None:
        while not stop.wait(interval):
            try:
                latest[0] = source.read()
            except DlprofError as error:
                screen.say(error.one_line())  # the last screen stays; the next read may do
                continue
            screen.show()

    reader = threading.Thread(target=fetch, name="dlprof-top-fetch", daemon=True)
    screen.show()
    reader.start()
    try:
        while not screen.quit.wait(0.2):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        screen.close()
    return ExitCode.FINISHED


def _print_once(source: MetricsUrl, first: Readings, pid: int | None, interval: float,
                out: TextIO) -> int:
    console = Console(file=out, width=PRINT_COLUMNS, color_system=None)
    # A second read past the agent's next pass, for rates over it.
    time.sleep(max(interval, first.value("dlprof_agent_interval_seconds") or 0.0) + 0.1)
    second = source.read()
    if pid is None:
        console.print(render_targets(target_rows(second, first), -1, source.metrics_url()))
        return ExitCode.FINISHED
    state = ViewState()
    frame = build_frame(second, first, pid)
    state.remember(frame)
    console.print(render(frame, state, PRINT_COLUMNS, PRINT_LINES))
    return ExitCode.FINISHED
