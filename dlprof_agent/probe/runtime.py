"""The one probe of this process: started by ``dlprof_agent.probe.enable()``, the
injected bootstrap, the `run` preload (``preload/``) or, at interpreter start,
DLPROF_PROBE=1 (``enable_at_launch``), and forgotten in a forked child. The probe
itself is ``server.Probe``."""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections.abc import Mapping

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


LAUNCH_ENV = "DLPROF_PROBE"


def launch_requested(environ: Mapping[str, str]) -> bool:
    """Whether the environment asks for the probe at launch: DLPROF_PROBE set,
    and not to 0 or empty (so that a job can turn it off for one command)."""
    return environ.get(LAUNCH_ENV, "") not in ("", "0")


def enable_at_launch() -> None:
    """Called at interpreter start (by ``dlprof_agent_probe.pth`` in site-packages,
    or the preload sitecustomize on PYTHONPATH) when DLPROF_PROBE asks for it: the
    probe sleeps until an agent connects, and it goes back to sleep when the
    agent leaves. Nothing raises into the job's start."""
    if not launch_requested(os.environ):
        return
    with contextlib.suppress(Exception):
        enable(persistent=True)


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
