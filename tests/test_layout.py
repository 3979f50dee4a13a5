"""The package's layering, read from its own imports (every import statement,
including those inside functions and under TYPE_CHECKING: a lazy import is
still a dependency).

Floors, bottom up: errors; the probe (runs inside the job); collectors;
reaching a process (reach/); the agent's link to the probe (probe_link/); the
data model with the findings' rules; exporters, dashboards and workloads; the
agent (sampling loops and serving); the commands (cli/); the entry point. An
import may go down or stay on its floor, never up, and never round in a circle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "dlprof_agent"

FLOORS = {
    "dlprof_agent": 0,  # the package's __init__: a docstring and the version
    "dlprof_agent.errors": 0,
    "dlprof_agent.probe": 1,
    "dlprof_agent.collectors": 2,
    "dlprof_agent.reach": 3,
    "dlprof_agent.probe_link": 4,
    "dlprof_agent.model": 5,
    "dlprof_agent.exporters": 6,
    "dlprof_agent.grafana": 6,
    "dlprof_agent.workloads": 6,
    "dlprof_agent.agent": 7,
    "dlprof_agent.cli": 8,
    "dlprof_agent.__main__": 9,
}

# Each vendor library is imported by one module (or, for prometheus_client, one
# package): the seam where tests put a fake, and the one place to read its use.
VENDOR_HOMES = {
    "pynvml": ("dlprof_agent.collectors.nvml",),
    # What procfs does not say plainly (the core counts) comes from psutil.
    "psutil": ("dlprof_agent.collectors.host",),
    "cupti": ("dlprof_agent.probe.cupti_binding",),
    "prometheus_client": ("dlprof_agent.exporters.",),
    "grafana_client": ("dlprof_agent.grafana.",),
    # The dashboards are code written with the SDK: every module that draws one uses it.
    "grafana_foundation_sdk": ("dlprof_agent.grafana.",),
}

# Files longer than this say at the top of their docstring why they are one file.
MAX_LINES = 450
LONG_FILE_REASON = "Kept in one file:"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_names(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            # `from package import module` imports the module.
            yield from (f"{node.module}.{alias.name}" for alias in node.names
                        if f"{node.module}.{alias.name}" in MODULES)


def internal_imports(module: str) -> set[str]:
    found = set()
    for name in imported_names(MODULES[module]):
        if name.startswith("dlprof_agent") and name != module:
            # The deepest module of ours the name is, or is inside.
            ours = name
            while ours not in MODULES:
                ours = ours.rpartition(".")[0]
            if ours != module and not module.startswith(ours + "."):
                found.add(ours)
    return found


GRAPH = {module: internal_imports(module) for module in MODULES}


def floor_of(module: str) -> int:
    key = max((k for k in FLOORS if module == k or module.startswith(k + ".")), key=len)
    return FLOORS[key]


def test_every_module_has_a_floor() -> None:
    for module in MODULES:
        assert any(module == k or module.startswith(k + ".") for k in FLOORS), module


def test_no_import_runs_back_up() -> None:
    upward = [f"{module} (floor {floor_of(module)}) imports {dep} (floor {floor_of(dep)})"
              for module, deps in GRAPH.items() for dep in sorted(deps)
              if floor_of(dep) > floor_of(module)]
    assert not upward, "\n".join(upward)


def test_the_import_graph_has_no_circles() -> None:
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return [*path[path.index(module):], module]
        if module in done:
            return None
        path.append(module)
        for dep in sorted(GRAPH[module]):
            circle = visit(dep)
            if circle:
                return circle
        path.pop()
        done.add(module)
        return None

    for module in MODULES:
        circle = visit(module)
        assert circle is None, " -> ".join(circle)


# What each room below the agent must not know, floors aside: none knows the
# commands or the sampling loops; only the exporters render; and the data model
# and reaching a process, side by side on one floor, know nothing of each other.
UNKNOWN_BELOW = {
    "dlprof_agent.probe": ("dlprof_agent.exporters", "dlprof_agent.reach"),
    "dlprof_agent.collectors": ("dlprof_agent.exporters", "dlprof_agent.reach"),
    "dlprof_agent.model": ("dlprof_agent.exporters", "dlprof_agent.reach"),
    "dlprof_agent.reach": ("dlprof_agent.exporters", "dlprof_agent.model"),
    "dlprof_agent.exporters": ("dlprof_agent.reach",),
}


@pytest.mark.parametrize("lower", sorted(UNKNOWN_BELOW))
def test_lower_floors_know_neither_the_agent_nor_the_commands(lower: str) -> None:
    forbidden = ("dlprof_agent.agent", "dlprof_agent.cli", *UNKNOWN_BELOW[lower])
    for module, deps in GRAPH.items():
        if module.startswith(lower + ".") or module == lower:
            assert not [d for d in deps if d.startswith(forbidden)], module


def test_the_entry_point_only_dispatches() -> None:
    # `python -m dlprof_agent` and the console script both go through cli/main.py.
    assert GRAPH["dlprof_agent.__main__"] == {"dlprof_agent.cli.main"}


def test_the_probe_imports_only_itself_and_the_errors() -> None:
    # It runs inside the user's job, whose environment may lack psutil and the rest.
    for module, deps in GRAPH.items():
        if module == "dlprof_agent.probe" or module.startswith("dlprof_agent.probe."):
            others = {d for d in deps
                      if d != "dlprof_agent.probe" and not d.startswith("dlprof_agent.probe.")}
            assert others <= {"dlprof_agent", "dlprof_agent.errors"}, module


def _at_home(module: str, home: str) -> bool:
    return module.startswith(home) if home.endswith(".") else module == home


@pytest.mark.parametrize("vendor", sorted(VENDOR_HOMES))
def test_each_vendor_library_has_one_home(vendor: str) -> None:
    importers = {module for module, path in MODULES.items()
                 if any(name == vendor or name.startswith(vendor + ".")
                        for name in imported_names(path))}
    strays = sorted(m for m in importers
                    if not any(_at_home(m, home) for home in VENDOR_HOMES[vendor]))
    assert not strays, f"{vendor} is imported outside {VENDOR_HOMES[vendor]}: {strays}"


def test_long_files_say_why_they_are_one_file() -> None:
    long_files = []
    for path in MODULES.values():
        lines = path.read_text().count("\n")
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        if lines > MAX_LINES and LONG_FILE_REASON not in docstring:
            long_files.append(f"{path.relative_to(REPO)}: {lines} lines")
    assert not long_files, "\n".join(long_files)


def test_the_package_is_plain_folders() -> None:
    # Links hide files from tools (every file twice, or imports unresolved).
    links = [p for p in PACKAGE.rglob("*") if p.is_symlink()]
    assert not links, links


# The injector's /proc front reads by pid; bootstrap_files.py reads the pids of
# other agents and jobs from the names of files they left behind.
BARE_PID_ALLOWED = {"dlprof_agent.reach.procfs", "dlprof_agent.reach.bootstrap_files"}


def test_the_injectors_take_the_job_as_a_target_not_a_pid() -> None:
    """A job reaches reach/ as one Target (collectors/target.py), made where its pid
    was given or found: an injector that took a bare pid would read the start time
    again, or not at all, and the job's trip through the rooms grows again."""
    bare = []
    for module, path in MODULES.items():
        if not module.startswith("dlprof_agent.reach.") or module in BARE_PID_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                bare += [f"{module}.{node.name}" for argument in arguments
                         if argument.arg == "pid"]
    assert bare == []
