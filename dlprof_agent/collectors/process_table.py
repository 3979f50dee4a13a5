"""Every process on the host, refreshed from procfs reading only what changed.

A refresh lists the pids and reads each one's stat (its parent, start time and
name); a process is known by its pid and start time, so a reused pid is a new
process. What does not change after its exec is read once: whether its command
line matches, its environment (the one at exec). A process may exec soon after
it forks, keeping its pid and start time: until it has been seen by
SETTLE_REFRESHES refreshes, and again whenever its name changes (an exec names it
after the new program), those are read afresh.
This replaces psutil's process_iter, parents() and children(recursive=True),
which read every process's stat and command line again on each call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dlprof_agent.collectors.procfs import (
    PROC_ROOT,
    list_pids,
    read_cmdline,
    read_environ,
    read_stat,
)
from dlprof_agent.errors import TargetGone

# A command line is matched whole up to this size, as psutil would read it.
CMDLINE_MATCH_BYTES = 128 << 10
SETTLE_REFRESHES = 3
_UNREAD = object()


@dataclass(slots=True)
class Entry:
    """One process as last seen."""

    pid: int
    start_ticks: int  # clock ticks since boot
    ppid: int
    comm: str
    seen: int = 1  # refreshes that found it
    matched: bool | None = None  # its command line against the table's patterns, once
    environ: object = field(default=_UNREAD)  # dict[str, str] | None once read


class ProcessTable:
    """pid -> Entry for every process; ``refresh()`` brings it up to date."""

    def __init__(self, *, root: str = PROC_ROOT,
                 matches: Callable[[str], bool] | None = None) -> None:
        self._root = root
        self._matches = matches
        self.entries: dict[int, Entry] = {}
        self._children: dict[int, list[int]] | None = None

    def refresh(self) -> None:
        known, entries = self.entries, {}
        for pid in list_pids(root=self._root):
            try:
                stat = read_stat(pid, root=self._root)
            except (TargetGone, ValueError, IndexError):
                continue  # gone between the listing and the read
            if stat is None:
                continue
            entry = known.get(pid)
            if (entry is None or entry.start_ticks != stat.start_ticks
                    or entry.comm != stat.comm):
                entry = Entry(pid, stat.start_ticks, stat.ppid, stat.comm)
            else:
                entry.ppid = stat.ppid  # reparented when its parent exits
                entry.seen += 1
                if entry.seen <= SETTLE_REFRESHES:  # it may have exec'd since
                    entry.matched, entry.environ = None, _UNREAD
            entries[pid] = entry
        self.entries = entries
        self._children = None

    def matching(self) -> list[int]:
        """The pids whose command line (arguments joined by spaces) matches."""
        found = []
        for entry in self.entries.values():
            if entry.matched is None:
                entry.matched = self._match(entry.pid)
            if entry.matched:
                found.append(entry.pid)
        return found

    def _match(self, pid: int) -> bool:
        if self._matches is None:
            return False
        try:
            command = read_cmdline(pid, root=self._root, limit_bytes=CMDLINE_MATCH_BYTES)
        except TargetGone:
            return False
        return command is not None and bool(command) and self._matches(command)

    def environ(self, pid: int) -> dict[str, str] | None:
        """The environment ``pid`` started with, read once; None when it cannot be
        read (another user's process, or gone)."""
        entry = self.entries.get(pid)
        if entry is None:
            return _environ(pid, self._root)
        if entry.environ is _UNREAD:
            entry.environ = _environ(pid, self._root)
        return entry.environ  # type: ignore[return-value]

    def children(self, pid: int) -> list[int]:
        """``pid``'s children, each started after it (a smaller start is a pid reused
        by a process that cannot be its child)."""
        if self._children is None:
            children: dict[int, list[int]] = {}
            for entry in self.entries.values():
                children.setdefault(entry.ppid, []).append(entry.pid)
            self._children = children
        parent = self.entries.get(pid)
        if parent is None:
            return []
        return sorted(child for child in self._children.get(pid, ())
                      if self.entries[child].start_ticks >= parent.start_ticks)

    def descendants(self, pid: int) -> list[int]:
        """Every descendant of ``pid``, each parent before its children."""
        found: list[int] = []
        level = self.children(pid)
        seen = {pid}
        while level:
            found += [child for child in level if child not in seen]
            seen.update(level)
            level = [grandchild for child in level for grandchild in self.children(child)
                     if grandchild not in seen]
        return found

    def ancestors(self, pid: int) -> list[int]:
        """``pid``'s parent, its parent's parent, ... up to the first process."""
        found: list[int] = []
        entry = self.entries.get(pid)
        while entry is not None and entry.ppid > 0 and entry.ppid not in found:
            found.append(entry.ppid)
            entry = self.entries.get(entry.ppid)
        return found


def _environ(pid: int, root: str) -> dict[str, str] | None:
    try:
        return read_environ(pid, root=root)
    except TargetGone:
        return None
