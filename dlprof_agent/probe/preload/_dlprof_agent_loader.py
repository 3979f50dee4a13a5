"""Starts the probe inside a target process, whatever Python and environment it
has: dlprof_agent is loaded from the agent's installation only if the target
has none, and the agent's site-packages never join the target's sys.path.
Shared by the injected bootstrap and the `run` preload; the standard library only."""

import sys


def load(parent, persistent):  # type: ignore[no-untyped-def]
    if sys.version_info < (3, 10):
        return
    try:
        if "dlprof_agent" not in sys.modules:
            import importlib.machinery
            import importlib.util

            spec = importlib.machinery.PathFinder.find_spec("dlprof_agent", [parent])
            if spec is None or spec.loader is None:
                return
            module = importlib.util.module_from_spec(spec)
            sys.modules["dlprof_agent"] = module
            spec.loader.exec_module(module)
        from dlprof_agent.probe import runtime

        runtime.enable(persistent=persistent)
    except Exception:
        pass
