"""The in-process probe: step time, samples, per-layer time and framework
settings, measured inside the training process and read by the agent.

It costs nothing until an agent attaches: one thread sleeping on a socket.
To keep it always available without injection, add to the training script::

    import dlprof_agent.probe
    dlprof_agent.probe.enable()

and, for loops the probe cannot see into, mark steps yourself::

    dlprof_agent.probe.step(samples=batch_size)

Only the standard library is imported here; framework hooks load when the
framework is already imported and an agent is attached.
"""

from __future__ import annotations

import contextlib
import sys

# Imported by enable(), not here: the agent reads the protocol and messages of this
# package, and the runtime (the server, the handlers, the kernel tracer) added 1.1
# MiB to a daemon's RSS.
_RUNTIME = f"{__name__}.runtime"


def enable() -> bool:
    """Start the dormant probe (once per process). False if no private socket
    directory could be made; the job runs on unaffected either way."""
    try:
        from dlprof_agent.probe import runtime

        return runtime.enable(persistent=True) is not None
    except Exception:
        return False


def step(samples: int | None = None) -> None:
    """Mark the end of a training step, with its number of samples. Cheap when
    no agent is attached; outranks the automatic step detection when one is."""
    # Not imported: no probe was ever started. Being imported (an injection on
    # the probe's thread): half a module, whose names may not be there yet.
    current = getattr(sys.modules.get(_RUNTIME), "current", None)
    with contextlib.suppress(Exception):
        probe = current() if current is not None else None
        if probe is not None:
            probe.mark_step(samples)


__all__ = ["enable", "step"]
