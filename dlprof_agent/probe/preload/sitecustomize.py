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


PRELOAD_MARK = b"dlprof-agent preload sitecustomize"


def _chain() -> None:
    import importlib.machinery
    import importlib.util

    # Another copy of this file further on (two probe copies on PYTHONPATH, or
    # `run` around a job launched with one) is passed over: each would chain to
    # the other for ever.
    skipped = {os.path.dirname(os.path.abspath(__file__))}
    while True:
        others = [entry for entry in sys.path if os.path.abspath(entry or ".") not in skipped]
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
        if spec is None or spec.loader is None or not spec.origin:
            return
        try:
            with open(spec.origin, "rb") as found:
                ours = PRELOAD_MARK in found.read()
        except OSError:
            ours = False
        if not ours:
            break
        skipped.add(os.path.dirname(os.path.abspath(spec.origin)))
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_start_probe()
_chain()
