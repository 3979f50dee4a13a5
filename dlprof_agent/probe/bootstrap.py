"""What gets the probe into a process: the code injected into a running one,
and the environment that preloads it into a command started by ``run``."""

from __future__ import annotations

import os

import dlprof_agent

PACKAGE_PARENT_ENV = "DLPROF_AGENT_PACKAGE_PARENT"
PRELOAD_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preload")

# Runs inside the target, whatever Python and environment it has (see the file).
LOADER_PATH = os.path.join(PRELOAD_DIR, "_dlprof_agent_loader.py")


def package_parent() -> str:
    """The folder holding the dlprof_agent package the agent runs from."""
    return os.path.dirname(os.path.dirname(os.path.abspath(dlprof_agent.__file__)))


def injection_code() -> str:
    """What the injector runs in the target: it starts a thread that loads the
    probe, and returns at once, so the job's thread it borrowed goes straight
    back to work. One expression: it defines no names in the job's __main__."""
    with open(LOADER_PATH) as source:
        body = source.read() + f"\nload({package_parent()!r}, False)\n"
    return ("__import__('_thread').start_new_thread(exec, "
            f"({body!r}, {{'__name__': 'dlprof_agent_bootstrap'}}))")


def preload_environment(environ: dict[str, str]) -> dict[str, str]:
    """The environment for `run`: Python imports sitecustomize from PYTHONPATH
    before the user's script, and ours chains to any sitecustomize of theirs."""
    result = dict(environ)
    existing = result.get("PYTHONPATH")
    result["PYTHONPATH"] = PRELOAD_DIR + (os.pathsep + existing if existing else "")
    result[PACKAGE_PARENT_ENV] = package_parent()
    return result
