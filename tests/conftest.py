"""Shared fixtures for the end-to-end tests: a busy multi-threaded process, the
agent attached to it, and a real Prometheus server scraping the agent; and the
test tiers: what makes a test slow, and a fast tier that never imports slow files."""

from __future__ import annotations

import ast
import contextlib
import fcntl
import functools
import itertools
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import SCRAPE_TIMEOUT_SECONDS, wait_until

REPO = Path(__file__).resolve().parents[1]
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")

# Every process a test starts inherits this run's mark (one per pytest process, so
# one per xdist worker), and a daemon started by a test watches only processes that
# carry it (OWN_JOBS): a daemon finds jobs node-wide, by their probe sockets, and
# would otherwise take another worker's jobs for its own.
TEST_RUN_ENV = "DLPROF_TEST_RUN"
os.environ[TEST_RUN_ENV] = uuid.uuid4().hex
OWN_JOBS = ("--env", f"{TEST_RUN_ENV}={os.environ[TEST_RUN_ENV]}")


def agent_env() -> dict[str, str]:
    """The environment, plus this checkout on PYTHONPATH unless it is importable already:
    a new dict each call, which the caller may change."""
    return dict(_agent_env())


@functools.cache
def _agent_env() -> dict[str, str]:
    env = dict(os.environ)
    probe = subprocess.run(
        [sys.executable, "-c", "import dlprof_agent; print(dlprof_agent.__file__)"],
        env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=30,
        check=False)
    found = Path(probe.stdout.strip()).resolve().parent if probe.returncode == 0 else None
    if found != REPO / "dlprof_agent":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO),
                                                          env.get("PYTHONPATH")]))
    return env


# Fixtures that start a real Prometheus, agent or job: a test that asks for one is
# slow whatever its file says, so a new end-to-end test cannot land in the fast tier
# by forgetting its mark. Likewise the e2e and gpu markers imply slow.
SLOW_FIXTURES = frozenset({"prometheus", "agent", "busy", "processes"})
SLOW_MARKERS = frozenset({"e2e", "gpu"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        markers = {mark.name for mark in item.iter_markers()}
        if fixtures & SLOW_FIXTURES or markers & SLOW_MARKERS:
            item.add_marker(pytest.mark.slow)


def pytest_report_header() -> list[str]:
    """The CPU, kernel and gdb the injector's tests ran on (a register state test that
    skips or fails depends on them): its features, XCR0 and its XSAVE sizes."""
    cpu, flags = "unknown CPU", ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name":
                cpu = value
            elif key == "flags":
                flags = " ".join(flag for flag in value.split() if flag.startswith(
                    ("avx", "amx", "xsave", "pku", "ospke")))
                break
    try:
        from dlprof_agent.reach.xsave_layout import LayoutUnknown, host_layout
    except ImportError as error:
        xsave = f"XSAVE layout unknown ({error})"
    else:
        try:
            layout = host_layout()
        except LayoutUnknown as error:
            xsave = f"XSAVE layout unknown ({error})"
        else:
            xsave = (f"XCR0 {layout.xcr0:#x}, XSAVE {layout.size(layout.xcr0)} bytes "
                     f"({layout.size(layout.xcr0 & ~layout.dynamic)} without XFD-guarded "
                     "state)")
    gdb = shutil.which("gdb")
    try:
        version = subprocess.run([gdb, "--version"], capture_output=True, text=True,
                                 timeout=10, check=False).stdout if gdb else ""
    except (OSError, subprocess.TimeoutExpired):
        version = ""
    return [f"cpu: {cpu}: {flags}",
            f"{xsave}; kernel {platform.release()}; "
            f"{(version.splitlines() or ['no gdb'])[0]}"]


# Parallel runs. Plain `pytest` (the suite from its testpaths) runs on WORKERS xdist
# workers, more than the cores: the slow tests mostly wait (for Prometheus to scrape,
# a grace to pass, a job to warm up). The fast tier, mostly CPU, runs on one worker a
# core (36 s against 63 s in one process, on 2 cores). Naming files, `-n N` or
# `-p no:xdist` runs as asked. A test marked `serial` runs alone: it takes the run's
# lock exclusively while every other test holds it shared. The serial tests are one
# unit of the scheduler, run first and back to back on one worker (SERIAL_SCOPE).
WORKERS = 2 * (os.cpu_count() or 1)
LOCKS_ENV = "DLPROF_TEST_LOCKS"


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config) -> Any:
    option = config.option
    if (getattr(option, "numprocesses", 0) is None and not hasattr(config, "workerinput")
            and config.args_source is pytest.Config.ArgsSource.TESTPATHS
            and not option.usepdb and not option.collectonly):
        option.numprocesses = (WORKERS if _selects_slow_tests(option.markexpr)
                               else os.cpu_count() or 1)
        if option.dist == "no":
            option.dist = "loadgroup"
    if getattr(option, "numprocesses", None) and LOCKS_ENV not in os.environ:
        # The workers inherit the controller's environment.
        os.environ[LOCKS_ENV] = tempfile.mkdtemp(prefix="dlprof-test-locks-")
    try:
        return (yield)
    finally:
        if getattr(option, "numprocesses", None) and not hasattr(config, "workerinput"):
            shutil.rmtree(os.environ.pop(LOCKS_ENV, ""), ignore_errors=True)


@functools.cache
def _one_worker_file(path: str) -> bool:
    """Whether the test file at ``path`` carries a whole-file ``xdist_group``."""
    return "xdist_group" in file_markers(REPO / path)[0]


# The scheduler's unit that holds every test marked serial: one worker runs them back to
# back, first (the largest units go first), while the others wait once behind the lock.
SERIAL_SCOPE = "serial"


@functools.cache
def _serial_tests(path: str) -> frozenset[str]:
    """Names of the test functions of the file at ``path`` decorated with the serial
    mark, read from its source as ``file_markers`` reads it."""
    try:
        tree = ast.parse((REPO / path).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    return frozenset(
        statement.name for statement in tree.body
        if isinstance(statement, ast.FunctionDef)
        and any("serial" in _mark_names(decorator) for decorator in statement.decorator_list))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """--dist loadgroup, with a file whose ``pytestmark`` holds an xdist_group run
    whole on one worker. xdist's own loadgroup names the group in each test's node
    id, which pytest 9 no longer lets a plugin change: every test was a group of
    its own there."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import (  # type: ignore[import-not-found,import-untyped,unused-ignore]
        LoadScopeScheduling,
    )

    class FileGroups(LoadScopeScheduling):  # type: ignore[misc,unused-ignore]
        def _split_scope(self, nodeid: str) -> str:
            if "@" in nodeid:  # xdist named the group, where pytest still allows it
                return nodeid.rsplit("@", 1)[-1]
            path, _, test = nodeid.partition("::")
            if _one_worker_file(path):
                return path
            return SERIAL_SCOPE if test.split("[", 1)[0] in _serial_tests(path) else nodeid

    return FileGroups(config, log)


def _selects_slow_tests(expression: str) -> bool:
    """Whether ``-m`` can select a slow test (one marked slow, or e2e and slow)."""
    if not expression:
        return True
    try:
        from _pytest.mark.expression import Expression  # no public API evaluates -m
        compiled = Expression.compile(expression)
        return any(compiled.evaluate(_has_marker(markers))
                   for markers in ({"slow"}, {"slow", "e2e"}))
    except Exception:  # another pytest's private API: run in parallel as asked
        return True


@contextlib.contextmanager
def _run_lock(exclusive: bool) -> Iterator[None]:
    """Shared for every test of a parallel run, exclusive for a serial one. A test
    that wants it exclusive first takes the gate, which the others pass through on
    their way in, so that tests starting meanwhile wait behind it and it does not
    wait for ever."""
    directory = os.environ.get(LOCKS_ENV)
    if directory is None or not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    with open(os.path.join(directory, "gate"), "a") as gate, \
            open(os.path.join(directory, "run"), "a") as run:
        fcntl.flock(gate, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        fcntl.flock(run, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not exclusive:
            fcntl.flock(gate, fcntl.LOCK_UN)
        yield


# The exclusive lock, while this worker holds it: a stack to close, or none
_serial_run: list[contextlib.ExitStack] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """A serial test takes the lock exclusively, and keeps it while the next test of
    this worker is serial too: the serial tests run as one unit (``SERIAL_SCOPE``),
    so the others drain once for all of them, not once each."""
    if item.get_closest_marker("serial") is None:
        with _run_lock(exclusive=False):
            return (yield)
    if not _serial_run:
        _serial_run.append(contextlib.ExitStack())
        _serial_run[0].enter_context(_run_lock(exclusive=True))
    try:
        return (yield)
    finally:
        if nextitem is None or nextitem.get_closest_marker("serial") is None:
            _serial_run.pop().close()


def _mark_names(node: ast.AST) -> set[str]:
    """Names X of every ``pytest.mark.X`` under ``node``."""
    return {each.attr for each in ast.walk(node)
            if isinstance(each, ast.Attribute) and isinstance(each.value, ast.Attribute)
            and each.value.attr == "mark"}


def file_markers(path: Path) -> tuple[set[str], set[str]]:
    """A test file's markers, read from its source without importing it: those of
    its top-level ``pytestmark`` (slow added where e2e or gpu imply it), and those
    any of its tests may add."""
    try:
        tree = ast.parse(path.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return set(), set()
    whole: set[str] = set()
    for statement in tree.body:
        if isinstance(statement, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "pytestmark"
                for target in statement.targets):
            whole |= _mark_names(statement.value)
    if whole & SLOW_MARKERS:
        whole.add("slow")
    return whole, _mark_names(tree) - whole


def _has_marker(markers: set[str]) -> Callable[..., bool]:
    return lambda name, /, **_: name in markers


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m``, a file marked slow as a whole is not even imported when the
    expression leaves out every test it could hold: importing torch or TensorFlow
    to collect tests that are then deselected would cost the fast tier most of its
    minute. Every other file is collected, and ``-m`` deselects as usual."""
    expression = config.getoption("markexpr", "")
    if not expression or collection_path.suffix != ".py" \
            or not collection_path.name.startswith("test_"):
        return None
    whole, per_test = file_markers(collection_path)
    if "slow" not in whole or len(per_test) > 8:
        return None
    try:
        from _pytest.mark.expression import Expression  # no public API evaluates -m
        compiled = Expression.compile(expression)
        for extra in itertools.chain.from_iterable(
                itertools.combinations(sorted(per_test), size)
                for size in range(len(per_test) + 1)):
            if compiled.evaluate(_has_marker(whole | set(extra))):
                return None
    except Exception:  # another pytest's private API: collect, and let -m deselect
        return None
    return True


def gdb_refusal() -> str | None:
    """Why gdb cannot be trusted here to call into a job and put its thread back (a
    skip's reason), or None: gdb missing, or one that cannot restore this CPU's register
    state (AMX). Only tests in which gdb makes its calls need this; a test that ends
    before any call uses ``force_gdb``."""
    from dlprof_agent.reach.gdb_versions import gdb_version, xstate_refusal
    from dlprof_agent.reach.xsave_layout import LayoutUnknown, XsaveLayout, host_layout
    gdb_path = shutil.which("gdb")
    if gdb_path is None:
        return "gdb is not installed"
    try:
        layout: XsaveLayout | None = host_layout()
    except LayoutUnknown:
        layout = None
    return xstate_refusal(gdb_version(gdb_path), layout)


def force_gdb(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gdb path for the rest of the test, even where the agent would refuse gdb
    (AMX): for tests in which the agent or gdb's script stops before gdb calls
    anything in the job (a job gone, at exit, no safe point, another file, XSAVE not
    writable), so that their code paths run on every CPU. Skips only without gdb."""
    if hasattr(sys, "remote_exec"):
        pytest.skip("from Python 3.14 the agent injects with sys.remote_exec, not gdb")
    if shutil.which("gdb") is None:
        pytest.skip("gdb is not installed")
    from dlprof_agent.reach import gdb as gdb_module
    from dlprof_agent.reach import inject as inject_module
    monkeypatch.setattr(inject_module, "plan_calls", lambda target, runtime: None)
    monkeypatch.setattr(gdb_module, "_refuse_unsafe_gdb", lambda target, gdb: None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """``wait_until`` with the argument order these fixtures' callers use."""
    return wait_until(condition, timeout, interval=0.2, what=what)


def http_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_SECONDS) as response:
        return bytes(response.read())


def spawn(args: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(10)


class Prometheus:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def query(self, promql: str) -> list[dict[str, Any]]:
        body = http_get(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        answer = json.loads(body)
        assert answer["status"] == "success", answer
        return list(answer["data"]["result"])

    def value(self, promql: str) -> float:
        result = self.query(promql)
        assert len(result) == 1, (promql, result)
        return float(result[0]["value"][1])


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[Any]]]:
    """Processes a test starts. At its end each one still there is killed, with its
    process group when it leads one (started in a session of its own), after a
    SIGCONT should the test have stopped it; then it is reaped and its pipes closed."""
    started: list[subprocess.Popen[Any]] = []
    yield started
    for process in started:
        if process.returncode is None:  # not reaped yet: its pid is still its own
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # none unless it leads a group
            if process.poll() is None:
                process.kill()
        process.wait(10)
        for pipe in (process.stdin, process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def busy() -> Iterator[subprocess.Popen[bytes]]:
    process = spawn([sys.executable, "-m", "dlprof_agent.workloads.busy", "--threads", "3"])
    assert process.stdout is not None
    process.stdout.readline()  # it prints once its threads run
    yield process
    if process.poll() is None:
        os.kill(process.pid, signal.SIGCONT)
    stop(process)


@pytest.fixture
def agent(busy: subprocess.Popen[bytes]) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    process = spawn([sys.executable, "-m", "dlprof_agent", "attach", str(busy.pid),
                     "--port", str(port), "--interval", "0.5", "--grace", "4", "--quiet"])
    wait_for(lambda: http_get(f"http://127.0.0.1:{port}/healthz"), "the agent's /healthz")
    yield process, port
    stop(process)


@contextlib.contextmanager
def running_prometheus(config: Path, data: Path, cwd: Path | None = None
                       ) -> Iterator[Prometheus]:
    """A real Prometheus server on ``config``, ready, stopped on leaving."""
    if PROMETHEUS is None:
        pytest.fail("the prometheus server is not installed (Debian package `prometheus`)")
    port = free_port()
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={data}",
         f"--web.listen-address=127.0.0.1:{port}"],
        cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = Prometheus(port)
    try:
        wait_for(lambda: http_get(f"{server.url}/-/ready"), "Prometheus to be ready")
        yield server
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture
def prometheus(tmp_path: Path, agent: tuple[subprocess.Popen[bytes], int]
               ) -> Iterator[Prometheus]:
    if PROMETHEUS is None:
        pytest.fail("the prometheus server is not installed (Debian package `prometheus`)")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: dlprof\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{agent[1]}']}}]\n")
    with running_prometheus(config, tmp_path / "data") as server:
        yield server


@pytest.fixture
def python_sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A Python process that sleeps for a minute, killed after the test."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()
