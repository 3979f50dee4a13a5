"""Loaded by Python at start-up in commands started with `dlprof-agent run`, and
in jobs whose PYTHONPATH holds a copy of the probe (`dlprof-agent probe-copy`)
and that set DLPROF_PROBE=1: starts the dormant probe, then runs the
sitecustomize this one shadows."""

import os
import sys


def _start_probe() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    parent = os.environ.get("DLPROF_AGENT_PACKAGE_PARENT")
    if not parent:
        if os.environ.get("DLPROF_PROBE", "") in ("", "0"):
            return
        # A copy made by probe-copy holds the package beside this file; in the
        # installed package this file is three folders down.
        parent = here if os.path.isdir(os.path.join(here, "dlprof_agent")) else (
            os.path.dirname(os.path.dirname(os.path.dirname(here))))
    try:
        namespace: dict[str, object] = {"__name__": "dlprof_agent_bootstrap"}
        with open(os.path.join(here, "_dlprof_agent_loader.py")) as source:
            exec(source.read(), namespace)
        load = namespace["load"]
        if callable(load):
            load(parent, True)
    except Exception:
        pass


def _chain() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    others = [entry for entry in sys.path if os.path.abspath(entry or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_start_probe()
_chain()
