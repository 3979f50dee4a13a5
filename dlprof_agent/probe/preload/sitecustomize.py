"""Loaded by Python at start-up in commands started with `dlprof-agent run`:
starts the dormant probe, then runs the sitecustomize this one shadows."""

import os
import sys


def _start_probe() -> None:
    parent = os.environ.get("DLPROF_AGENT_PACKAGE_PARENT")
    if not parent:
        return
    try:
        here = os.path.dirname(os.path.abspath(__file__))
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
