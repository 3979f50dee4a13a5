"""What reaching a process's probe is waiting for right now, in a few words, so
that the agent can show it while it waits (``attach``'s progress line). ``connect``
says each step here, the injector's own waits through the ``say_waiting`` it is
handed; nothing is waited on through it."""

from __future__ import annotations

import threading
import time

_lock = threading.Lock()
# pid -> (what it waits for, since when on time.monotonic(), tries of this step)
_steps: dict[int, tuple[str, float, int]] = {}


def waiting_for(pid: int, what: str, *, tries: int = 1) -> None:
    """Reaching ``pid`` now waits for ``what`` (tried ``tries`` times so far)."""
    with _lock:
        known = _steps.get(pid)
        since = known[1] if known is not None and known[0] == what else time.monotonic()
        _steps[pid] = (what, since, tries)


def done(pid: int) -> None:
    with _lock:
        _steps.pop(pid, None)


def current(pid: int) -> tuple[str, float, int] | None:
    """What reaching ``pid`` waits for, the seconds it has waited for it, and the
    tries; None when nothing is under way."""
    with _lock:
        known = _steps.get(pid)
    if known is None:
        return None
    what, since, tries = known
    return what, time.monotonic() - since, tries
