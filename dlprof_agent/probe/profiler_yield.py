"""Standing aside for the job's own profiler before it touches CUPTI.

CUPTI's activity kinds, buffer callbacks and timestamp source are process-wide.
Kineto (torch.profiler) claims CUPTI while the profiler is being *prepared*,
before ``torch._C._autograd._profiler_enabled()`` turns true (GPU evidence
2026-11-23, item 3): noticing that flag on the probe's next tick is too late.
So the entry points that prepare, enable and disable the profiler are wrapped:

- torch: ``_prepare_profiler`` and ``_enable_profiler`` (the tracer stands aside
  first, synchronously, on the job's thread) and ``_disable_profiler`` (it comes
  back once that has returned), in ``torch._C._autograd``, ``torch.autograd``
  and ``torch.autograd.profiler``, whose ``profile`` calls them as module
  globals;
- TensorFlow: ``start`` and ``stop`` of ``tensorflow.python.profiler.profiler_v2``
  (which ``tf.profiler.experimental.Profile`` calls as globals) and of the
  ``tf.profiler.experimental`` API modules that re-export them.

The wrappers call the tracers registered here and then the original; they
never raise anything of their own. With no tracer registered they are removed
again (where nobody wrapped them after us). The standard library only.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

TORCH_PROFILER = "torch.profiler"
TENSORFLOW_PROFILER = "TensorFlow's profiler"
_WRAPPED = "_dlprof_profiler_yield"  # marks our wrappers (its value: the original)

_TORCH_MODULES = ("torch._C._autograd", "torch.autograd", "torch.autograd.profiler")
_TORCH_STARTS = ("_prepare_profiler", "_enable_profiler")
_TORCH_STOPS = ("_disable_profiler",)
_TF_MODULES = ("tensorflow.python.profiler.profiler_v2",
               "tensorflow._api.v2.profiler.experimental",
               "tensorflow._api.v2.compat.v2.profiler.experimental")


class Yielding(Protocol):
    """What stands aside for the job's profiler: the kernel tracer."""

    def stand_aside(self, holder: str) -> None: ...

    def come_back(self, holder: str) -> None: ...


_lock = threading.Lock()
_tracers: list[Yielding] = []
_patched: list[tuple[Any, str, Any]] = []  # (the framework's module, name, wrapper)


def _notify(method: str, holder: str) -> None:
    with _lock:
        tracers = list(_tracers)
    for tracer in tracers:
        with contextlib.suppress(Exception):
            getattr(tracer, method)(holder)


def _starting(original: Callable[..., Any], holder: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _notify("stand_aside", holder)
        return original(*args, **kwargs)

    setattr(wrapper, _WRAPPED, original)
    return wrapper


def _stopping(original: Callable[..., Any], holder: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            _notify("come_back", holder)

    setattr(wrapper, _WRAPPED, original)
    return wrapper


def _targets() -> list[tuple[str, tuple[str, ...], tuple[str, ...], str]]:
    """(module name, start functions, stop functions, holder) for what is imported."""
    targets: list[tuple[str, tuple[str, ...], tuple[str, ...], str]] = [
        (name, _TORCH_STARTS, _TORCH_STOPS, TORCH_PROFILER) for name in _TORCH_MODULES]
    targets += [(name, ("start",), ("stop",), TENSORFLOW_PROFILER) for name in _TF_MODULES]
    return targets


def install() -> int:
    """Wrap the entry points of the profilers imported so far (again where a
    framework was imported since); how many are wrapped now."""
    with _lock:
        for module_name, starts, stops, holder in _targets():
            module = sys.modules.get(module_name)
            if module is None:
                continue
            for names, wrap in ((starts, _starting), (stops, _stopping)):
                for name in names:
                    original = getattr(module, name, None)
                    if original is None or hasattr(original, _WRAPPED):
                        continue
                    with contextlib.suppress(Exception):
                        wrapper = wrap(original, holder)
                        setattr(module, name, wrapper)
                        _patched.append((module, name, wrapper))
        return len(_patched)


def uninstall() -> None:
    """Put the originals back, where the attribute is still our wrapper."""
    with _lock:
        while _patched:
            module, name, wrapper = _patched.pop()
            with contextlib.suppress(Exception):
                if getattr(module, name, None) is wrapper:
                    setattr(module, name, getattr(wrapper, _WRAPPED))


def register(tracer: Yielding) -> None:
    """Tell ``tracer`` when the job's profiler starts and stops; wraps what is
    imported now (called each time tracing starts, so late imports are caught)."""
    with _lock:
        if not any(known is tracer for known in _tracers):
            _tracers.append(tracer)
    install()


def unregister(tracer: Yielding) -> None:
    with _lock:
        _tracers[:] = [known for known in _tracers if known is not tracer]
        empty = not _tracers
    if empty:
        uninstall()
