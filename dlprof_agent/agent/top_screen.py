"""`top`'s terminal: a Rich Live screen (the alternate screen, as htop's) drawn by
one thread of the agent, which also reads the keys. The sampler only hands it
each pass and wakes it, so drawing never delays a pass, and nothing of it runs
in the job. The agent's log lines go to the screen's last line meanwhile."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import sys
import termios
import threading
import tty
from collections.abc import Callable
from typing import TextIO

from rich.console import Console, RenderableType
from rich.live import Live

from dlprof_agent.agent.top_frame import Frame, TargetRow, build_frame, target_rows
from dlprof_agent.agent.top_view import SORTS, ViewState, render, render_targets
from dlprof_agent.exporters.metrics_reader import Readings

# How often the screen thread looks at the terminal's size when nothing else
# wakes it: a resize is redrawn within this.
RESIZE_CHECK_SECONDS = 0.25

log = logging.getLogger("dlprof_agent")


def _same_pass(readings: Readings, previous: Readings | None) -> bool:
    """Both reads show the agent's same sampling pass: nothing to take a rate over."""
    if previous is None:
        return False
    stamp = "dlprof_agent_last_sample_timestamp_seconds"
    return readings.value(stamp) == previous.value(stamp)


class _ScreenLog(logging.Handler):
    """The agent's log lines, shown on the screen's last line while it is up."""

    def __init__(self, screen: TopScreen) -> None:
        super().__init__()
        self._screen = screen

    def emit(self, record: logging.LogRecord) -> None:
        self._screen.say(record.getMessage())


UP_KEYS = ("\x1b[A", "\x1bOA", "k")  # ESC O: the arrows in application cursor mode
DOWN_KEYS = ("\x1b[B", "\x1bOB", "j")
ENTER_KEYS = ("\r", "\n")
BACK_KEYS = ("t",)


def split_keys(pressed: str) -> tuple[list[str], str]:
    """The keys of one read of the terminal, each escape sequence (an arrow's
    ESC [ B) one key, and an escape sequence the read cut short, to go before the
    next read: keys typed fast, or a busy agent, come in one read."""
    keys: list[str] = []
    at = 0
    while at < len(pressed):
        end = at + 1
        if pressed[at] == "\x1b" and pressed[at + 1:at + 2] in ("[", "O"):
            end = at + 2
            # Parameters and intermediates up to a final byte in @..~ (ECMA-48).
            while end < len(pressed) and not "@" <= pressed[end] <= "~":
                end += 1
            if end == len(pressed):
                return keys, pressed[at:]
            end += 1
        keys.append(pressed[at:end])
        at = end
    return keys, ""


class TopScreen:
    """The live screen of one target, or with ``pid`` None a table of the targets
    the metrics hold, Enter opening one (`top --url` on a daemon). ``read`` gives
    the latest metrics when the screen is woken (``wake``); ``keys`` maps a key to
    what it does, returning what to say. ``quit`` is set by q. ``source`` names
    where the metrics come from, for the table's title."""

    def __init__(self, pid: int | None, read: Callable[[], Readings | None], *,
                 keys: dict[str, Callable[[], str]] | None = None,
                 stream: TextIO | None = None, keyboard: TextIO | None = None,
                 source: str = "") -> None:
        self.pid = pid
        self.choosing = pid is None  # the targets table is up
        self.can_choose = pid is None  # t goes back to it
        self.chosen = 0
        self.targets: tuple[TargetRow, ...] = ()
        self.source = source
        self.note = ""  # what attach's status line would end with (the probe's start)
        self.quit = threading.Event()
        self.state = ViewState()
        self.frame: Frame | None = None
        self._read = read
        self._keys = dict(keys or {})
        self._stream = stream if stream is not None else sys.stdout
        self._keyboard = keyboard if keyboard is not None else sys.stdin
        self._console = Console(file=self._stream)
        self._live: Live | None = None
        self._thread: threading.Thread | None = None
        self._previous: Readings | None = None
        self._wake_read, self._wake_write = os.pipe()
        self._closed = threading.Event()
        self._saved_tty: list[object] | None = None
        self._saved_handlers: list[logging.Handler] | None = None
        self._lock = threading.Lock()
        self._cut_short = ""  # an escape sequence split between two reads

    # The sampler's side (attach's LiveStatus has the same two).
    def show(self, snapshot: object = None) -> None:
        """New metrics: start the screen on the first, then wake it."""
        if self._closed.is_set():
            return
        if self._thread is None:
            self.start()
        self.wake(b"d")

    def clear(self) -> None:
        """End the screen: the terminal as it was, the log back on stderr."""
        self.close()

    def wake(self, why: bytes = b"m") -> None:
        """Redraw; ``why`` b"d": new metrics to read first."""
        with contextlib.suppress(OSError):
            os.write(self._wake_write, why)

    def say(self, message: str) -> None:
        self.state.message = message
        self.wake()

    def start(self) -> None:
        with self._lock:
            if self._thread is not None or self._closed.is_set():
                return
            logger = logging.getLogger("dlprof_agent")
            self._saved_handlers = list(logger.handlers)
            logger.handlers[:] = [_ScreenLog(self)]
            with contextlib.suppress(termios.error, OSError, ValueError):
                fd = self._keyboard.fileno()
                self._saved_tty = termios.tcgetattr(fd)
                tty.setcbreak(fd)  # keys one at a time, unechoed; Ctrl-C still interrupts
            self._live = Live(console=self._console, screen=True, auto_refresh=False,
                              redirect_stdout=False, redirect_stderr=False)
            self._live.start()
            self._thread = threading.Thread(target=self._run, name="dlprof-top", daemon=True)
            self._thread.start()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.wake()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)
        with self._lock:
            if self._live is not None:
                with contextlib.suppress(Exception):
                    self._live.stop()
            if self._saved_tty is not None:
                with contextlib.suppress(termios.error, OSError, ValueError):
                    termios.tcsetattr(self._keyboard.fileno(), termios.TCSADRAIN,
                                      self._saved_tty)  # type: ignore[arg-type]
            if self._saved_handlers is not None:
                logging.getLogger("dlprof_agent").handlers[:] = self._saved_handlers
        # The wake pipe stays open: a late wake() from the sampler must not write
        # into a descriptor number that something else has taken since.

    # The screen thread.
    def _run(self) -> None:
        size = self._console.size
        fresh = keyboard = True
        while not self._closed.is_set():
            watched = [self._wake_read]
            if keyboard:
                with contextlib.suppress(OSError, ValueError):
                    watched.append(self._keyboard.fileno())
            try:
                ready, _, _ = select.select(watched, [], [], RESIZE_CHECK_SECONDS)
            except (OSError, ValueError):
                return
            if self._closed.is_set():
                return
            redraw = False
            if self._wake_read in ready:
                with contextlib.suppress(OSError):
                    fresh = b"d" in os.read(self._wake_read, 4096) or fresh
                redraw = True
            if len(watched) > 1 and watched[1] in ready:
                pressed = os.read(watched[1], 16)
                keyboard = bool(pressed)  # at its end (a closed terminal), keys are done
                redraw = self._key(pressed.decode(errors="replace")) or redraw
            if self._console.size != size:
                size, redraw = self._console.size, True
            if redraw:
                try:
                    self.draw(fresh)
                except Exception:  # a bug in drawing must not take the agent down
                    log.debug("top: drawing failed", exc_info=True)
                fresh = False

    def _key(self, pressed: str) -> bool:
        """Act on the keys pressed, in order; True when the screen changes."""
        changed = False
        keys, self._cut_short = split_keys(self._cut_short + pressed)
        for key in keys:
            changed = self._one_key(key) or changed
        return changed

    def _one_key(self, key: str) -> bool:
        if self.choosing:
            return self._choose(key)
        if self.can_choose and key in BACK_KEYS:
            self.choosing = True
            return True
        if key == "q":
            self.quit.set()
        elif key == "?":
            self.state.help = not self.state.help
        elif key == "s":
            self.state.sort = SORTS[(SORTS.index(self.state.sort) + 1) % len(SORTS)]
            self.state.message = f"sorted by {self.state.sort}"
        elif key in self._keys:
            self.state.message = self._keys[key]()
        else:
            return False
        return True

    def _choose(self, key: str) -> bool:
        if key == "q":
            self.quit.set()
        elif key in UP_KEYS:
            self.chosen = max(0, self.chosen - 1)
        elif key in DOWN_KEYS:
            self.chosen = min(len(self.targets) - 1, self.chosen + 1)
        elif key in ENTER_KEYS and self.targets:
            pid = self.targets[min(self.chosen, len(self.targets) - 1)].pid
            if pid != self.pid:
                self.pid, self.frame, self.state = pid, None, ViewState()
                if self._previous is not None:
                    self.frame = build_frame(self._previous, None, pid)
            self.choosing = False
            self.state.message = "t: back to the targets"
        else:
            return False
        return True

    def draw(self, fresh: bool = True) -> None:
        """Read the metrics (when ``fresh``) and draw the screen."""
        if fresh:
            readings = self._read()
            if readings is not None and not _same_pass(readings, self._previous):
                self.targets = target_rows(readings, self._previous)
                if self.pid is not None:
                    self.frame = build_frame(readings, self._previous, self.pid)
                    self.state.remember(self.frame)
                self._previous = readings
        live = self._live
        if live is None:
            return
        if self.choosing:
            live.update(render_targets(self.targets, self.chosen, self.source), refresh=True)
            return
        frame = self.frame
        if frame is None:
            return
        width, height = self._console.size
        live.update(self.renderable(frame, width, height), refresh=True)

    def renderable(self, frame: Frame, width: int, height: int) -> RenderableType:
        self.state.note = self.note
        return render(frame, self.state, width, height)
