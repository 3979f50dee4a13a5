"""Every module of the package imports on its own, and none but the reference
models loads a framework: the commands start without waiting seconds for torch or
TensorFlow, and the probe enters a job without importing one for it. This is also
what keeps every module in the fast tier (``pytest -m "not slow"``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import REPO, agent_env

# Built on a framework, so importing them loads it: the slow tier tests them.
FRAMEWORK_MODULES = frozenset({
    "dlprof_agent.workloads.keras_models",
    "dlprof_agent.workloads.torch_models",
    "dlprof_agent.workloads.torch_train",
})
# Run rather than imported: __main__ runs the command line (tests/test_cli.py runs
# it); preload/ is executed by path in a job started with `run` (the last test here).
NOT_IMPORTED = ("dlprof_agent.__main__", "dlprof_agent.probe.preload")
FRAMEWORKS = ("torch", "tensorflow", "keras", "jax")


def package_modules() -> list[str]:
    modules = []
    for path in sorted((REPO / "dlprof_agent").rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules.append(".".join(parts))
    return modules


def test_every_module_imports_and_none_but_the_models_loads_a_framework() -> None:
    modules = [m for m in package_modules() if m not in FRAMEWORK_MODULES
               and not m.startswith(NOT_IMPORTED)]
    assert len(modules) > 80  # the walk found the package
    check = textwrap.dedent(f"""
        import importlib, json, sys
        loaded = {{}}
        for name in {modules!r}:
            importlib.import_module(name)
            loaded[name] = [f for f in {FRAMEWORKS!r} if f in sys.modules]
        print(json.dumps(loaded))
    """)
    result = subprocess.run([sys.executable, "-c", check], cwd=REPO, env=agent_env(),
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout)
    assert sorted(loaded) == sorted(modules)
    assert {name: frameworks for name, frameworks in loaded.items() if frameworks} == {}


def test_a_python_started_with_the_run_environment_has_its_probe(tmp_path: Path) -> None:
    """preload/ as `run` uses it: its sitecustomize loads the package through the
    loader and enables the probe before the job's own code runs."""
    from dlprof_agent.probe.bootstrap import preload_environment
    from dlprof_agent.probe.protocol import SOCKET_DIR_ENV

    env = preload_environment({**agent_env(), SOCKET_DIR_ENV: str(tmp_path / "run")})
    check = ("from dlprof_agent.probe import runtime; "
             "print(runtime.current() is not None and runtime.current().path)")
    result = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(tmp_path / "run")), result.stdout
