"""The one /proc reader, against a captured tree (tests/data/procfs/, written by
tests/capture_procfs.py, with psutil's view of the same live processes beside it),
against this machine's own /proc, and the source rule that only the two /proc fronts
(the agent's and the injector's) build /proc paths."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dlprof_agent.collectors.procfs import (
    CLOCK_TICKS_PER_SECOND,
    ENVIRON_MAX_ENTRIES,
    ENVIRON_VALUE_MAX_CHARS,
    PAGE_SIZE_BYTES,
    CgroupEntry,
    Io,
    ProcessFiles,
    ResourceLimit,
    Schedstat,
    count_fds,
    list_tasks,
    may_read_io,
    owner_uid,
    parse_stat,
    read_cgroups,
    read_cmdline,
    read_comm,
    read_environ,
    read_io,
    read_limits,
    read_schedstat,
    read_stat,
    read_state,
    read_status,
    read_task_stats,
)
from dlprof_agent.errors import TargetGone

REPO = Path(__file__).resolve().parents[1]
TREE = REPO / "tests" / "data" / "procfs"
ROOT = str(TREE)
MANIFEST: dict[str, Any] = json.loads((TREE / "manifest.json").read_text())
PROCESSES: dict[str, dict[str, Any]] = MANIFEST["processes"]
LIVE = [role for role in PROCESSES if role != "zombie"]
SAME_UNITS = (MANIFEST["clock_ticks_per_second"] == CLOCK_TICKS_PER_SECOND
              and MANIFEST["page_size_bytes"] == PAGE_SIZE_BYTES)
STATE_LETTERS = {"sleeping": "S", "zombie": "Z", "running": "R"}


def pid_of(role: str) -> int:
    return int(PROCESSES[role]["pid"])


def seen_by_psutil(role: str) -> dict[str, Any]:
    return dict(PROCESSES[role]["psutil"])


def raw_stat_fields(pid: int) -> list[str]:
    """The fields after the name, split here without the reader."""
    return (TREE / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()


@pytest.fixture
def tree_copy() -> Iterator[Path]:
    """A copy of the captured tree that others may enter (for a reader without root)."""
    folder = Path(tempfile.mkdtemp(prefix="dlprof-procfs-"))
    try:
        os.chmod(folder, 0o755)
        copy = folder / "proc"
        shutil.copytree(TREE, copy)
        yield copy
    finally:
        shutil.rmtree(folder)


def as_another_user(read: Callable[[], object]) -> object:
    """``read()``, run where the kernel refuses what only the owner or root may read:
    in a child process as nobody when the tests run as root, else here."""
    if os.geteuid() != 0:
        return read()
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            os.write(writer, repr(read()).encode())
        except BaseException as error:
            os.write(writer, f"raised {type(error).__name__}".encode())
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        answer = pipe.read().decode()
    os.waitpid(child, 0)
    return answer


# --- the captured tree -------------------------------------------------------------


@pytest.mark.parametrize("role", list(PROCESSES))
def test_stat_of_each_captured_process(role: str) -> None:
    pid, psutil_view, fields = pid_of(role), seen_by_psutil(role), raw_stat_fields(pid_of(role))
    stat = read_stat(pid, root=ROOT)
    assert stat is not None
    assert stat.pid == pid
    assert stat.comm == psutil_view["name"]
    assert stat.state == STATE_LETTERS[psutil_view["status"]]
    assert stat.ppid == psutil_view["ppid"]
    assert stat.threads == psutil_view["threads"]
    assert stat.start_ticks == int(fields[22 - 3])
    assert stat.vms_bytes == psutil_view["vms_bytes"]
    assert stat.rss_bytes == int(fields[24 - 3]) * PAGE_SIZE_BYTES
    assert stat.iowait_seconds == int(fields[42 - 3]) / CLOCK_TICKS_PER_SECOND
    if SAME_UNITS:
        assert stat.user_seconds == pytest.approx(psutil_view["user_seconds"])
        assert stat.system_seconds == pytest.approx(psutil_view["system_seconds"])
    # No rss against psutil's here: psutil reads statm, whose count the kernel keeps
    # current, while stat's may lag by a few pages (status's VmRSS is compared below).


def test_a_name_with_parentheses_and_spaces_is_read_whole() -> None:
    stat = read_stat(pid_of("plain"), root=ROOT)
    assert stat is not None and stat.comm == "py) (plain job"
    assert stat.state == "S"
    forged = parse_stat("7 (a) R 1 (b) ) S 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22")
    assert (forged.comm, forged.state, forged.ppid) == ("a) R 1 (b) ", "S", 3)


@pytest.mark.parametrize("role", list(PROCESSES))
def test_status_of_each_captured_process(role: str) -> None:
    pid, psutil_view = pid_of(role), seen_by_psutil(role)
    status = read_status(pid, root=ROOT)
    assert status is not None
    assert status.name == psutil_view["name"]
    assert status.state == STATE_LETTERS[psutil_view["status"]]
    assert status.ppid == psutil_view["ppid"]
    assert status.tracer_pid == 0
    assert list(status.uids[:3]) == psutil_view["uids"]
    assert status.nspid[0] == pid
    assert status.threads == psutil_view["threads"]
    assert status.voluntary_context_switches == psutil_view["voluntary"]
    assert status.involuntary_context_switches == psutil_view["involuntary"]
    for mask in (status.sig_blk, status.cap_prm, status.cap_eff):
        assert isinstance(mask, int)
    if role == "zombie":  # it has no memory left
        assert (status.vm_rss_bytes, status.vm_hwm_bytes) == (None, None)
    else:
        assert status.vm_rss_bytes == psutil_view["rss_bytes"]
        assert status.vm_rss_bytes is not None and status.vm_hwm_bytes is not None
        assert status.vm_hwm_bytes >= status.vm_rss_bytes


def test_threads_are_named_by_their_comm_main_first() -> None:
    pid, psutil_view = pid_of("threaded"), seen_by_psutil("threaded")
    threads = read_task_stats(pid, root=ROOT)
    assert threads[0].tid == pid
    assert sorted(thread.tid for thread in threads) == psutil_view["thread_ids"]
    assert sorted(thread.name for thread in threads) == ["loader 0", "loader) 1", "reducer",
                                                         "trainer"]
    assert {thread.state for thread in threads} == {"S"}
    assert all(thread.user_seconds >= 0 and thread.system_seconds >= 0
               and thread.iowait_seconds >= 0 for thread in threads)
    assert list_tasks(pid, root=ROOT) == [thread.tid for thread in threads]


@pytest.mark.parametrize("role", list(PROCESSES))
def test_io_open_fds_limits_and_cgroups(role: str) -> None:
    pid, psutil_view = pid_of(role), seen_by_psutil(role)
    io = psutil_view["io"]
    assert read_io(pid, root=ROOT) == Io(
        read_chars=io["read_chars"], write_chars=io["write_chars"],
        read_syscalls=io["read_count"], write_syscalls=io["write_count"],
        read_bytes=io["read_bytes"], write_bytes=io["write_bytes"], cancelled_write_bytes=0)
    assert count_fds(pid, root=ROOT) == psutil_view["open_fds"]
    limits = read_limits(pid, root=ROOT)
    assert limits is not None
    soft, hard = MANIFEST["open_files"]
    assert limits["Max open files"] == ResourceLimit(soft, hard, "files")
    assert limits["Max cpu time"] == ResourceLimit(None, None, "seconds")
    assert limits["Max realtime timeout"].unit == "us"
    cgroups = read_cgroups(pid, root=ROOT)
    assert cgroups is not None and cgroups
    assert {entry.path for entry in cgroups} == {MANIFEST["cgroup_path"]}
    v2 = [entry for entry in cgroups if entry.hierarchy == 0]
    assert v2 == [] or v2 == [CgroupEntry(0, (), MANIFEST["cgroup_path"])]


def test_environ_comm_and_command_line() -> None:
    for role in ("plain", "threaded", "zombie parent"):
        assert read_environ(pid_of(role), root=ROOT) == MANIFEST["environment"]
    assert read_comm(pid_of("threaded"), root=ROOT) == "trainer"
    command = read_cmdline(pid_of("threaded"), root=ROOT)
    assert command is not None and command.startswith("python3 -c ")
    assert read_cmdline(pid_of("zombie"), root=ROOT) == ""


def test_the_zombie_is_read_as_exited() -> None:
    pid = pid_of("zombie")
    assert read_state(pid, root=ROOT) == "Z"
    assert [thread.state for thread in read_task_stats(pid, root=ROOT)] == ["Z"]
    assert count_fds(pid, root=ROOT) == 0
    # The kernel answers ESRCH for a zombie's environ (see the live test): the capture
    # has none, which reads as None.
    assert read_environ(pid, root=ROOT) is None


def test_an_absent_environ_is_none() -> None:
    assert read_environ(pid_of("unreadable"), root=ROOT) is None


def test_an_unreadable_environ_is_none(tree_copy: Path) -> None:
    pid = pid_of("unreadable")
    environ = tree_copy / str(pid) / "environ"
    environ.write_bytes(b"SECRET=1\0")
    environ.chmod(0o000)
    assert as_another_user(lambda: read_environ(pid, root=str(tree_copy))) in (None, "None")
    files = ProcessFiles(pid, root=str(tree_copy))
    assert as_another_user(lambda: (files.environ(), files.stat() is not None)) in (
        (None, True), "(None, True)")


def test_a_process_of_another_user_is_read_where_allowed() -> None:
    """The kernel's own refusal: environ and io of a process the reader does not own."""
    other = os.getpid() if os.geteuid() == 0 else 1  # read as nobody; else init, root's
    if owner_uid(other) == os.geteuid() != 0:
        pytest.skip("init runs as this user here")
    assert as_another_user(lambda: (read_environ(other), read_io(other), may_read_io(other),
                                    read_stat(other) is not None)) in (
        (None, None, False, True), "(None, None, False, True)")


# --- the per-pass cache and processes that go ----------------------------------------


def test_process_files_read_each_file_once(tree_copy: Path) -> None:
    pid = pid_of("threaded")
    files = ProcessFiles(pid, root=str(tree_copy))
    first = (files.stat(), files.status(), files.threads(), files.io(), files.environ(),
             files.cgroups(), files.limits(), files.open_fds(), files.owner_uid())
    for name in ("stat", "status", "io", "environ", "cgroup", "limits"):
        (tree_copy / str(pid) / name).write_text("")
    shutil.rmtree(tree_copy / str(pid) / "task")
    again = (files.stat(), files.status(), files.threads(), files.io(), files.environ(),
             files.cgroups(), files.limits(), files.open_fds(), files.owner_uid())
    assert again == first
    assert len(first[2]) == 4


def test_a_process_that_goes_mid_pass_raises_target_gone(tree_copy: Path) -> None:
    pid = pid_of("plain")
    files = ProcessFiles(pid, root=str(tree_copy))
    stat = files.stat()
    shutil.rmtree(tree_copy / str(pid))
    assert files.stat() == stat  # read before it went
    for read in (files.status, files.threads, files.io, files.environ, files.cgroups,
                 files.limits, files.open_fds, files.owner_uid):
        with pytest.raises(TargetGone) as gone:
            read()
        assert gone.value.pid == pid
    with pytest.raises(TargetGone):
        files.status()  # every time it is asked
    assert read_state(pid, root=str(tree_copy)) is None


def test_a_thread_that_ends_mid_listing_is_left_out(tree_copy: Path) -> None:
    pid = pid_of("threaded")
    ended = PROCESSES["threaded"]["tids"][-1]
    (tree_copy / str(pid) / "task" / str(ended) / "stat").unlink()
    assert ended not in [thread.tid for thread in read_task_stats(pid, root=str(tree_copy))]
    assert len(read_task_stats(pid, root=str(tree_copy))) == 3


def test_a_file_this_kernel_lacks_is_none(tree_copy: Path) -> None:
    pid = pid_of("plain")
    (tree_copy / str(pid) / "io").unlink()
    assert read_io(pid, root=str(tree_copy)) is None
    assert may_read_io(pid, root=str(tree_copy))


# --- environ bounds -----------------------------------------------------------------


def test_environ_is_bounded_and_decoded_with_replacement(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    huge = b"x" * (1 << 20)
    (tmp_path / "42" / "environ").write_bytes(
        b"BEFORE=1\0HUGE=" + huge + b"\0BAD=\xff\xfe\0AFTER=2\0NO_END=3")
    environment = read_environ(42, root=str(tmp_path))
    assert environment is not None
    assert environment["HUGE"] == "x" * ENVIRON_VALUE_MAX_CHARS
    assert environment["BAD"] == "\ufffd\ufffd"
    assert (environment["BEFORE"], environment["AFTER"], environment["NO_END"]) == ("1", "2", "3")


def test_environ_keeps_a_bounded_number_of_variables(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "environ").write_bytes(
        b"".join(b"V%d=1\0" % index for index in range(ENVIRON_MAX_ENTRIES + 100)))
    environment = read_environ(42, root=str(tmp_path))
    assert environment is not None and len(environment) == ENVIRON_MAX_ENTRIES


# --- this machine's /proc -----------------------------------------------------------


def test_this_process_read_live() -> None:
    files = ProcessFiles(os.getpid())
    stat, status = files.stat(), files.status()
    assert stat is not None and status is not None
    assert stat.pid == os.getpid() and stat.ppid == os.getppid()
    assert stat.state == "R"  # it is reading
    assert status.uids[0] == os.getuid()
    environment = files.environ()
    assert environment is not None and "PATH" in environment
    assert all(len(value) <= ENVIRON_VALUE_MAX_CHARS for value in environment.values())
    open_fds = files.open_fds()
    assert open_fds is not None and open_fds >= 3
    assert os.getpid() in [thread.tid for thread in files.threads()]


def test_a_live_zombie() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 60
        while read_state(child.pid) != "Z":
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.01)
        assert read_stat(child.pid) is not None
        with pytest.raises(TargetGone):
            read_environ(child.pid)
        assert read_cmdline(child.pid) == ""
    finally:
        child.wait()
    assert read_state(child.pid) is None
    with pytest.raises(TargetGone):
        read_stat(child.pid)


# --- the source ---------------------------------------------------------------------

PACKAGE = REPO / "dlprof_agent"
READER = PACKAGE / "collectors" / "procfs.py"
# The injector's own front: the paths it opens in a job (its memory, root, mapped files)
INJECTOR_FRONT = PACKAGE / "reach" / "procfs.py"
PROC_FRONTS = (READER, INJECTOR_FRONT)
# The probe runs inside the job and imports only itself and errors: it reads its own
# /proc/self/maps. Code texts that the injectors hand to the job run there, not here.
IN_THE_JOB = ("probe",)
CODE_RUN_IN_THE_JOB = {"_PENDING_BODY", "_GDB_PYTHON"}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _code_texts(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id in CODE_RUN_IN_THE_JOB
                for target in node.targets):
            found |= {id(inner) for inner in ast.walk(node.value)}
    return found


def proc_paths_built(path: Path) -> list[str]:
    """Where a module spells a /proc path itself: a string holding "/proc" (not a
    docstring), or an f-string that joins a procfs root variable to more path."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = _docstrings(tree) | _code_texts(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                "/proc" in node.value):
            found.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: {node.value[:40]!r}")
        elif isinstance(node, ast.JoinedStr) and any(
                isinstance(part, ast.FormattedValue)
                and isinstance(part.value, (ast.Name, ast.Attribute))
                and "procfs" in ast.unparse(part.value) for part in node.values):
            found.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: {ast.unparse(node)[:60]}")
    return found


def test_only_the_two_proc_fronts_build_or_open_proc_paths() -> None:
    offenders = [
        place for path in sorted(PACKAGE.rglob("*.py"))
        if path not in PROC_FRONTS and path.relative_to(PACKAGE).parts[0] not in IN_THE_JOB
        for place in proc_paths_built(path)]
    assert offenders == []


def test_the_source_check_sees_what_it_forbids(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text('"""Reads /proc/<pid>/stat."""\n'
                      'A = open("/proc/self/stat")\n'
                      'B = f"/proc/{1}/io"\n'
                      'def f(procfs: str) -> str:\n'
                      '    return f"{procfs}/1/environ"\n'
                      '_GDB_PYTHON = "open(\'/proc/%d/maps\')"\n')
    assert [place.split(":")[1] for place in proc_paths_built(module)] == ["2", "3", "5"]
    assert READER.read_text().count('"/proc"') == 1  # the default root, once


def test_schedstat_is_the_main_thread_on_a_cpu_and_waiting_for_one(tmp_path: Path) -> None:
    (tmp_path / "123").mkdir()
    (tmp_path / "123" / "schedstat").write_text("2000000000 500000000 7\n")
    assert read_schedstat(123, root=str(tmp_path)) == Schedstat(2.0, 0.5)
    (tmp_path / "123" / "schedstat").write_text("not numbers\n")
    assert read_schedstat(123, root=str(tmp_path)) is None
    (tmp_path / "123" / "schedstat").unlink()  # a kernel without CONFIG_SCHED_INFO
    assert read_schedstat(123, root=str(tmp_path)) is None
    with pytest.raises(TargetGone):
        read_schedstat(124, root=str(tmp_path))
    if not Path("/proc/self/schedstat").exists():
        pytest.skip("this kernel keeps no schedstat (CONFIG_SCHED_INFO)")
    before = read_schedstat(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    after = read_schedstat(os.getpid())
    assert before is not None and after is not None
    assert after.run_seconds - before.run_seconds >= 0.04
    assert after.wait_seconds >= before.wait_seconds


def test_every_function_of_the_injectors_front_takes_the_procfs_root() -> None:
    tree = ast.parse(INJECTOR_FRONT.read_text())
    without = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)
               and "procfs" not in {arg.arg for arg in (*node.args.args, *node.args.kwonlyargs)}]
    assert without == []
