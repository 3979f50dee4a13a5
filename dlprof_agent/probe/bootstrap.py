"""What gets the probe into a process: the code injected into a running one,
the environment that preloads it into a command started by ``run``, and the
copy that an init container puts on a shared volume for images without the
package (``copy_probe``)."""

from __future__ import annotations

import os
import shutil

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


def copy_probe(destination: str) -> list[str]:
    """Copy what a job needs to start the probe at launch into ``destination``:
    the probe (the package's ``__init__``, ``errors`` and ``probe/``, the standard
    library only) and the preload's sitecustomize, which chains to the job's own.
    The job then sets PYTHONPATH=destination and DLPROF_PROBE=1. Returns the
    files written, relative to ``destination``."""
    package = os.path.join(package_parent(), "dlprof_agent")
    written: list[str] = []

    def copy(source: str, relative: str) -> None:
        target = os.path.join(destination, relative)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(source, target)
        written.append(relative)

    for name in ("__init__.py", "errors.py", "py.typed"):
        if os.path.exists(os.path.join(package, name)):
            copy(os.path.join(package, name), os.path.join("dlprof_agent", name))
    probe = os.path.join(package, "probe")
    for folder, _, files in os.walk(probe):
        for name in sorted(files):
            if name.endswith(".py"):
                source = os.path.join(folder, name)
                copy(source, os.path.join("dlprof_agent", "probe",
                                          os.path.relpath(source, probe)))
    for name in ("sitecustomize.py", "_dlprof_agent_loader.py"):
        copy(os.path.join(PRELOAD_DIR, name), name)
    return written
