"""The one probe of this process: started by ``dlprof_agent.probe.enable()``, the
injected bootstrap or the `run` preload (``preload/``), and forgotten in a
forked child. The probe itself is ``server.Probe``."""

from __future__ import annotations

import atexit
import os
import threading

from dlprof_agent.probe.server import Probe

_probe: Probe | None = None
_lock = threading.Lock()


def enable(*, persistent: bool = True) -> Probe | None:
    """Start the dormant probe once per process; later calls return it."""
    global _probe  # noqa: PLW0603 - one probe per process
    with _lock:
        if _probe is not None and _probe.pid == os.getpid() and _probe.listening:
            return _probe
        probe = Probe(persistent=persistent)
        if not probe.listen():
            return None
        _probe = probe
        atexit.register(probe.close_at_exit)
        return probe


def current() -> Probe | None:
    return _probe


def _forget_in_child() -> None:
    # A forked child (a data-loader worker) has no probe thread: drop the hooks it inherited.
    global _probe
    probe, _probe = _probe, None
    if probe is not None:
        session, probe.session = probe.session, None
        if session is not None:
            session.remove_hooks()  # CUPTI is left alone: the parent's, not the child's


os.register_at_fork(after_in_child=_forget_in_child)
