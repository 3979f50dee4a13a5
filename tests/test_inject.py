"""inject() and find_python_runtime() against real processes: Python interpreters of
several versions, a process that is not Python, a target the kernel will not let us
attach to, and one in another mount namespace. The ELF reader is also checked on
files built here, for every ELF class and byte order."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import pytest

import dlprof_agent
from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import InjectionFailed, InjectionRefused, NotPython, TargetNotFound
from dlprof_agent.reach.bootstrap_files import remove_later, write_bootstrap
from dlprof_agent.reach.elf import elf_defined_symbols
from dlprof_agent.reach.inject import inject
from dlprof_agent.reach.refusal import refused
from dlprof_agent.reach.remote_exec import inject_with_remote_exec
from dlprof_agent.reach.runtime import REQUIRED_SYMBOLS, PythonRuntime, find_python_runtime
from tests.helpers import wait_until, without_eval_loop_stops

HAS_GDB = shutil.which("gdb") is not None
# Tests of what only the gdb path meets; 3.14+ uses sys.remote_exec.
gdb_path = pytest.mark.skipif(hasattr(sys, "remote_exec") or not HAS_GDB,
                              reason="the agent injects with sys.remote_exec, not gdb")
PACKAGE_PARENT = str(Path(dlprof_agent.__file__).resolve().parent.parent)
STATIC_PYTHON = "/usr/bin/python3.11"  # Debian's: the C API is exported by the executable

# Runs until the file named by argv[1] exists (at most 20 s), then exits 0.
LOOP = """
import os, sys, time
print("ready", flush=True)
deadline = time.monotonic() + 20
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.02)
"""

# Writes the target's pid to a file, atomically, from inside the target.
WRITE_PID = """
import os
with open({tmp!r}, "w") as f:
    f.write(str(os.getpid()))
os.replace({tmp!r}, {path!r})
"""


class Spawn(Protocol):
    def __call__(self, args: list[str], *, ready: bool = True) -> subprocess.Popen[str]: ...


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Starts processes in their own session; kills whatever is left afterwards."""
    started: list[subprocess.Popen[str]] = []

    def start(args: list[str], *, ready: bool = True) -> subprocess.Popen[str]:
        process = subprocess.Popen(args, text=True, start_new_session=True, cwd="/",
                                   stdout=subprocess.PIPE if ready else subprocess.DEVNULL)
        started.append(process)
        if ready:  # past its startup (and any exec by a wrapper): it is the interpreter now
            assert process.stdout is not None
            assert process.stdout.readline() == "ready\n", f"{args[0]} did not start"
        return process

    yield start
    for process in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


def interpreter(version: str) -> str:
    """A python binary for ``version`` ("3.12", or "agent" for sys.executable)."""
    if version == "agent":
        return sys.executable
    found = [path for path in (shutil.which(f"python{version}"),) if path is not None]
    found += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/"
                                                 f"python{version}")))
    real = [path for path in found if "/shims/" not in path and os.access(path, os.X_OK)]
    if not real:
        pytest.skip(f"python {version} is not installed")
    return real[0]


def still_running(process: subprocess.Popen[str]) -> bool:
    time.sleep(0.2)  # a process killed by an injection dies within milliseconds
    return process.poll() is None


def needs_root_and(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed")
    if os.geteuid() != 0:
        pytest.skip("needs root to start processes as other users")
    return path


# --- find_python_runtime --------------------------------------------------------------

def test_finds_the_runtime_of_the_agents_own_python(spawn: Spawn, tmp_path: Path) -> None:
    child = spawn([sys.executable, "-c", LOOP, str(tmp_path / "stop")])
    runtime = find_python_runtime(Target.of(child.pid))
    assert runtime is not None
    assert runtime.version == sys.version_info[:2]
    assert "python3" in os.path.basename(runtime.library)
    symbols = elf_defined_symbols(f"/proc/{child.pid}/root{runtime.library}")
    assert symbols is not None and symbols >= REQUIRED_SYMBOLS


def test_a_static_python_exports_from_its_executable(spawn: Spawn, tmp_path: Path) -> None:
    if not os.path.exists(STATIC_PYTHON):
        pytest.skip(f"{STATIC_PYTHON} is not installed")
    child = spawn([STATIC_PYTHON, "-c", LOOP, str(tmp_path / "stop")])
    runtime = find_python_runtime(Target.of(child.pid))
    if runtime is not None and "libpython" in runtime.library:
        pytest.skip(f"{STATIC_PYTHON} links libpython here")
    assert runtime == PythonRuntime(os.path.realpath(STATIC_PYTHON), (3, 11))


def test_the_version_comes_from_the_binary_when_the_name_says_nothing(
        spawn: Spawn, tmp_path: Path) -> None:
    if not os.path.exists(STATIC_PYTHON):
        pytest.skip(f"{STATIC_PYTHON} is not installed")
    renamed = tmp_path / "trainer"
    shutil.copy(STATIC_PYTHON, renamed)
    child = spawn([str(renamed), "-c", LOOP, str(tmp_path / "stop")])
    runtime = find_python_runtime(Target.of(child.pid))
    if runtime is not None and "libpython" in runtime.library:
        pytest.skip(f"{STATIC_PYTHON} links libpython here")
    assert runtime == PythonRuntime(str(renamed), (3, 11))  # read from Py_Version


def test_sleep_is_not_python(spawn: Spawn) -> None:
    sleep = spawn(["sleep", "30"], ready=False)
    wait_until(lambda: os.readlink(f"/proc/{sleep.pid}/exe").endswith("sleep"), 10,
               what="sleep's exec")
    assert find_python_runtime(Target.of(sleep.pid)) is None


def test_a_pid_without_a_process_is_target_not_found() -> None:
    """Both functions raise TargetNotFound (exit code 3), as the rest of the agent does
    for a missing target; InjectionFailed is kept for attempts that went wrong."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    with pytest.raises(TargetNotFound, match=f"no process with pid {gone.pid}"):
        find_python_runtime(Target(gone.pid, 0))
    with pytest.raises(TargetNotFound):
        inject(Target(gone.pid, 0), "pass")


def test_a_target_whose_pid_names_another_process_is_left_alone(spawn: Spawn,
                                                                  tmp_path: Path) -> None:
    """A Target that started at another time than the process now under its pid (the
    job exited and its pid was reused): nothing is injected into the newcomer."""
    stop, out = tmp_path / "stop", tmp_path / "pid"
    child = spawn([sys.executable, "-c", LOOP, str(stop)])
    earlier = Target(child.pid, Target.of(child.pid).start_ticks - 1)
    with pytest.raises(TargetNotFound, match=f"process {child.pid} has exited"):
        inject(earlier, WRITE_PID.format(tmp=str(out) + ".tmp", path=str(out)))
    time.sleep(0.5)
    assert not out.exists() and still_running(child)


# --- inject ---------------------------------------------------------------------------

def test_a_non_python_process_is_left_alone(spawn: Spawn) -> None:
    sleep = spawn(["sleep", "30"], ready=False)
    wait_until(lambda: os.readlink(f"/proc/{sleep.pid}/exe").endswith("sleep"), 10,
               what="sleep's exec")
    with pytest.raises(NotPython) as raised:
        inject(Target.of(sleep.pid), "pass")
    assert still_running(sleep), "the injection attempt killed the process"
    line = raised.value.one_line()
    assert "not a Python process" in line and "\n" not in line
    assert raised.value.exit_code == 2


@pytest.mark.parametrize("version", ["agent", "static", "3.10", "3.12", "3.13"])
def test_injected_code_runs_in_the_target(spawn: Spawn, tmp_path: Path, version: str) -> None:
    python = STATIC_PYTHON if version == "static" else interpreter(version)
    if not os.path.exists(python):
        pytest.skip(f"{python} is not installed")
    if not HAS_GDB and version not in ("agent", f"{sys.version_info[0]}.{sys.version_info[1]}"):
        pytest.skip("another python version needs gdb, which is not installed")
    stop, out = tmp_path / "stop", tmp_path / "pid"
    child = spawn([python, "-c", LOOP, str(stop)])
    inject(Target.of(child.pid), WRITE_PID.format(tmp=str(out) + ".tmp", path=str(out)))
    wait_until(out.exists, 10, what="the injected code to write its file")
    assert out.read_text() == str(child.pid)
    assert still_running(child)
    stop.touch()
    assert child.wait(5) == 0  # the job goes on and ends normally


def test_a_python_too_old_for_the_probe_is_left_alone(spawn: Spawn, tmp_path: Path) -> None:
    child = spawn([interpreter("3.9"), "-c", LOOP, str(tmp_path / "stop")])
    with pytest.raises(NotPython, match=r"python 3\.9, too old for the probe"):
        inject(Target.of(child.pid), "open('/dev/null')")
    assert still_running(child)


@pytest.mark.parametrize("how", [
    # root, but without CAP_SYS_PTRACE: it may not even read the target's executable
    ["--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace"],
    # reads /proc as nobody (fsuid), but ptrace checks the real uid: root, no capabilities
    ["--euid=nobody", "--egid=nogroup", "--clear-groups"],
], ids=["no-cap-sys-ptrace", "ptrace-denied"])
def test_a_refusal_says_what_is_needed(spawn: Spawn, tmp_path: Path, how: list[str]) -> None:
    setpriv = needs_root_and("setpriv")
    child = spawn([setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                   sys.executable, "-I", "-c", LOOP, str(tmp_path / "stop")])
    attempt = (
        "import sys\n"
        "from dlprof_agent.errors import DlprofError\n"
        "from dlprof_agent.collectors.target import Target\n"
        "from dlprof_agent.reach.inject import inject\n"
        "try:\n"
        "    inject(Target.of(int(sys.argv[1])), 'open(\"/dev/null\")')\n"
        "except DlprofError as error:\n"
        "    print(type(error).__name__, error.one_line())\n"
        "    sys.exit(error.exit_code)\n")
    result = subprocess.run([setpriv, *how, sys.executable, "-c", attempt, str(child.pid)],
                            capture_output=True, text=True, timeout=30, check=False,
                            env={**os.environ, "PYTHONPATH": PACKAGE_PARENT}, cwd="/")
    assert result.returncode == InjectionRefused.exit_code, result.stdout + result.stderr
    assert result.stdout.startswith("InjectionRefused not allowed to attach")
    assert result.stdout.count("\n") == 1
    assert "owned by user nobody" in result.stdout
    assert "CAP_SYS_PTRACE" in result.stdout and "--cap-add SYS_PTRACE" in result.stdout
    assert "root without it is not enough" in result.stdout
    assert still_running(child)


@gdb_path
def test_a_target_that_is_already_traced(spawn: Spawn, tmp_path: Path) -> None:
    # The child makes this test process its tracer (PTRACE_TRACEME); a second tracer is
    # refused by the kernel, and the message names the first one.
    traced = LOOP.replace('print("ready"', 'import ctypes\n'
                          'assert ctypes.CDLL(None).ptrace(0, 0, None, None) == 0\n'
                          'print("ready"')
    child = spawn([sys.executable, "-c", traced, str(tmp_path / "stop")])
    with pytest.raises(InjectionRefused, match=f"already traced by pid {os.getpid()}"):
        inject(Target.of(child.pid), "pass")
    assert still_running(child)


@gdb_path
def test_a_target_with_another_tmp(spawn: Spawn) -> None:
    """A job in its own mount namespace (another container, a private /tmp) gets the
    bootstrap through /proc/<pid>/root/tmp, so the injection works there too."""
    unshare = needs_root_and("unshare")
    probe = subprocess.run([unshare, "-m", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.decode().strip()}")
    # The child's own /tmp hides ours: its interpreter and files must live elsewhere.
    python = os.path.realpath(sys.executable)
    if python.startswith("/tmp/"):
        pytest.skip(f"the interpreter {python} lives in /tmp, which the test hides")
    shared = Path(tempfile.mkdtemp(dir="/var/tmp"))
    try:
        stop, out = shared / "stop", shared / "pid"
        child = spawn([unshare, "-m", "--propagation", "private", "sh", "-c",
                       'mount -t tmpfs none /tmp && exec "$0" -c "$1" "$2"',
                       python, LOOP, str(stop)])
        inject(Target.of(child.pid), WRITE_PID.format(tmp=str(out) + ".tmp", path=str(out)))
        wait_until(out.exists, 10, what="the injected code to write its file")
        assert still_running(child)
        stop.touch()
        assert child.wait(5) == 0
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.slow  # a timing window of seconds
@gdb_path
def test_a_job_that_never_releases_the_gil_is_left_running(
        spawn: Spawn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No safe point within the wait (a pure-Python spin, with the eval loop's own code
    not a stop, as where its extent is unknown): nothing is called in."""
    monkeypatch.setattr("dlprof_agent.reach.inject.SAFE_POINT_WAIT_SECONDS", 2.0)
    without_eval_loop_stops(monkeypatch)
    # Checking for a file would release the GIL around stat(): spin on the clock alone.
    spin = ("import time\nprint('ready', flush=True)\n"
            "end = time.monotonic() + 5\nwhile time.monotonic() < end: pass\n")
    child = spawn([sys.executable, "-c", spin])
    with pytest.raises(InjectionFailed, match="reached no safe point"):
        inject(Target.of(child.pid), "open('/dev/null')")
    assert still_running(child)
    assert _status(child.pid, "TracerPid") == "0"
    assert child.wait(10) == 0


def _status(pid: int, field: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return line.split(":", 1)[1].strip()
    return ""


def test_the_bootstrap_file_lands_in_the_targets_tmp(spawn: Spawn, tmp_path: Path) -> None:
    """The sys.remote_exec path (Python 3.14+) hands the target a path; the file must be
    in the target's /tmp, readable by any user, and go away later, even once the target
    has exited."""
    child = spawn([sys.executable, "-c", LOOP, str(tmp_path / "stop")])
    bootstrap = write_bootstrap(Target.of(child.pid), "print('hello')\n")
    assert bootstrap.seen_as.startswith("/tmp/dlprof-bootstrap-")
    local = Path(f"/proc/{child.pid}/root{bootstrap.seen_as}")
    assert local.read_text() == "print('hello')\n"
    assert stat.S_IMODE(local.stat().st_mode) == 0o644
    assert stat.S_IMODE(local.parent.stat().st_mode) == 0o711
    (tmp_path / "stop").touch()
    assert child.wait(5) == 0
    remove_later(bootstrap, 0.05)
    wait_until(lambda: not os.path.exists(os.path.dirname(bootstrap.seen_as)), 10,
               what="the bootstrap's removal")  # the child shared our /tmp


def test_the_remote_exec_path_with_a_stand_in(spawn: Spawn, tmp_path: Path) -> None:
    """Before Python 3.14 there is no sys.remote_exec; inject() plays it, running the file
    the real one would be given, so this checks the path works inside the target."""

    def remote_exec(pid: int, path: str) -> None:
        inject(Target.of(pid), f"exec(open({path!r}).read())")

    stop, out = tmp_path / "stop", tmp_path / "pid"
    child = spawn([sys.executable, "-c", LOOP, str(stop)])
    inject_with_remote_exec(Target.of(child.pid),
                            WRITE_PID.format(tmp=str(out) + ".tmp", path=str(out)),
                        remote_exec)
    wait_until(out.exists, 10, what="the bootstrap file to run")
    assert out.read_text() == str(child.pid)

    def refuse(pid: int, path: str) -> None:
        raise PermissionError(1, "Operation not permitted")

    with pytest.raises(InjectionRefused, match=r"sys\.remote_exec was denied"):
        inject_with_remote_exec(Target.of(child.pid), "pass", refuse)
    stop.touch()
    assert child.wait(5) == 0


@pytest.mark.parametrize(("scope", "says"), [
    ("1", "only a parent process may attach unless the agent has CAP_SYS_PTRACE"),
    ("2", "only a process with CAP_SYS_PTRACE may attach"),
    ("3", "attaching is disabled until reboot"),
])
def test_a_refusal_explains_yama(tmp_path: Path, scope: str, says: str) -> None:
    procfs = tmp_path / "proc"
    pid = fake_process(procfs, Path("/bin/sh"))
    (procfs / "sys" / "kernel" / "yama").mkdir(parents=True)
    (procfs / "sys" / "kernel" / "yama" / "ptrace_scope").write_text(f"{scope}\n")
    line = refused(Target(pid, 0, str(procfs)), "ptrace was denied").one_line()
    assert f"kernel.yama.ptrace_scope is {scope}: {says}" in line
    assert "\n" not in line


# --- the ELF reader -------------------------------------------------------------------

def elf(bits: int, order: str, symbols: dict[str, bool], py_version: int | None = None
        ) -> bytes:
    """A minimal ELF shared object: .dynsym, .dynstr and a .rodata holding Py_Version.
    ``symbols`` maps a name to whether it is defined (undefined ones are imports)."""
    wide = bits == 64
    header_format = order + ("HHIQQQIHHHHHH" if wide else "HHIIIIIHHHHHH")
    section_format = order + ("IIQQQQIIQQ" if wide else "IIIIIIIIII")
    word = 8 if wide else 4
    names = dict(symbols)
    if py_version is not None:
        names["Py_Version"] = True
    strings = b"\0"
    entries = [(0, 0, 0, 0)]  # name, shndx, value, size: index 0 is the null symbol
    for name, defined in names.items():
        value = 0x1000 if name == "Py_Version" else 0
        entries.append((len(strings), 3 if defined else 0, value, word if value else 0))
        strings += name.encode() + b"\0"

    def symbol(name: int, shndx: int, value: int, size: int) -> bytes:
        if wide:
            return struct.pack(order + "IBBHQQ", name, 0x12, 0, shndx, value, size)
        return struct.pack(order + "IIIBBH", name, value, size, 0x12, 0, shndx)

    table = b"".join(symbol(*entry) for entry in entries)
    rodata = (py_version or 0).to_bytes(word, "little" if order == "<" else "big")
    header_size = struct.calcsize(header_format) + 16
    strings_at = header_size
    table_at = strings_at + len(strings)
    rodata_at = table_at + len(table)
    sections_at = rodata_at + len(rodata)
    sections = [
        (0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
        (0, 11, 2, 0, table_at, len(table), 2, 1, word, len(table) // len(entries)),
        (0, 3, 2, 0, strings_at, len(strings), 0, 0, 1, 0),
        (0, 1, 2, 0x1000, rodata_at, len(rodata), 0, 0, word, 0),
    ]
    ident = b"\x7fELF" + bytes([2 if wide else 1, 1 if order == "<" else 2, 1]) + bytes(9)
    header = struct.pack(header_format, 3, 62 if wide else 3, 1, 0, 0, sections_at, 0,
                         header_size, 0, 0, struct.calcsize(section_format), len(sections), 0)
    return (ident + header + strings + table + rodata
            + b"".join(struct.pack(section_format, *s) for s in sections))


LAYOUTS = [(64, "<"), (32, "<"), (64, ">"), (32, ">")]
PYTHON_SYMBOLS = {**dict.fromkeys(REQUIRED_SYMBOLS, True), "malloc": False}


@pytest.mark.parametrize(("bits", "order"), LAYOUTS, ids=["64le", "32le", "64be", "32be"])
def test_reads_defined_symbols_of_every_elf_layout(tmp_path: Path, bits: int, order: str
                                                   ) -> None:
    path = tmp_path / "lib.so"
    path.write_bytes(elf(bits, order, PYTHON_SYMBOLS))
    assert elf_defined_symbols(str(path)) == REQUIRED_SYMBOLS  # malloc is only imported


def test_real_binaries() -> None:
    sleep = elf_defined_symbols(shutil.which("sleep") or "/bin/sleep")
    assert sleep is not None and not sleep & REQUIRED_SYMBOLS
    library = elf_defined_symbols(os.path.realpath(f"/proc/{os.getpid()}/exe"))
    if library is not None and not library >= REQUIRED_SYMBOLS:  # a libpython build
        with open(f"/proc/{os.getpid()}/maps") as maps:
            path = next(line.split()[-1] for line in maps if "libpython3" in line)
        library = elf_defined_symbols(path)
    assert library is not None and library >= REQUIRED_SYMBOLS


def test_files_that_are_not_elf_give_none(tmp_path: Path) -> None:
    text = tmp_path / "script.sh"
    text.write_text("#!/bin/sh\nexec sleep 30\n")
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert elf_defined_symbols(str(text)) is None
    assert elf_defined_symbols(str(empty)) is None
    assert elf_defined_symbols(str(tmp_path)) is None  # a directory
    assert elf_defined_symbols(str(tmp_path / "missing")) is None
    whole = elf(64, "<", PYTHON_SYMBOLS)
    for size in (3, 16, 40, len(whole) // 2, len(whole) - 1):
        truncated = tmp_path / f"truncated-{size}"
        truncated.write_bytes(whole[:size])
        assert elf_defined_symbols(str(truncated)) is None, size
    real = Path(os.path.realpath(shutil.which("sleep") or "/bin/sleep")).read_bytes()
    half = tmp_path / "half-of-sleep"
    half.write_bytes(real[: len(real) // 2])  # the section headers are at the end
    assert elf_defined_symbols(str(half)) is None


# --- a made-up /proc ------------------------------------------------------------------

def fake_process(procfs: Path, exe: Path, maps: str = "") -> int:
    pid = 4242
    (procfs / str(pid)).mkdir(parents=True)
    (procfs / str(pid) / "exe").symlink_to(exe)
    (procfs / str(pid) / "maps").write_text(maps)
    (procfs / str(pid) / "stat").write_text(f"{pid} (trainer) S 1")
    return pid


@pytest.mark.parametrize(("bits", "order"), LAYOUTS, ids=["64le", "32le", "64be", "32be"])
def test_version_from_py_version_when_the_exe_exports(tmp_path: Path, bits: int, order: str
                                                      ) -> None:
    exe = tmp_path / "bin" / "trainer"
    exe.parent.mkdir()
    exe.write_bytes(elf(bits, order, PYTHON_SYMBOLS, py_version=0x030C04F0))  # 3.12.4
    pid = fake_process(tmp_path / "proc", exe)
    runtime = find_python_runtime(Target.of(pid, procfs=str(tmp_path / "proc")))
    assert runtime == PythonRuntime(str(exe), (3, 12))


@pytest.mark.parametrize("deleted", [False, True], ids=["on-disk", "deleted"])
def test_libpython_found_through_the_targets_maps(tmp_path: Path, deleted: bool) -> None:
    """The library path is the target's; it is read through <pid>/root, or through
    <pid>/map_files when it was deleted since it was loaded."""
    exe = tmp_path / "python"
    exe.write_bytes(elf(64, "<", {"main": True, "PyRun_SimpleString": False}))
    library = "/opt/py/lib/libpython3.13.so.1.0"
    maps = ("5600000000-5600001000 r-xp 00000000 fe:00 12 /opt/py/bin/python\n"
            f"7f0000000000-7f0000001000 r--p 00000000 fe:00 34 {library}"
            f"{' (deleted)' if deleted else ''}\n")
    procfs = tmp_path / "proc"
    pid = fake_process(procfs, exe, maps)
    rootfs = tmp_path / "rootfs"
    (procfs / str(pid) / "root").symlink_to(rootfs)
    if deleted:
        (procfs / str(pid) / "map_files").mkdir()
        target = procfs / str(pid) / "map_files" / "7f0000000000-7f0000001000"
    else:
        target = rootfs / library.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(elf(64, "<", PYTHON_SYMBOLS))  # no Py_Version: the name tells
    runtime = find_python_runtime(Target.of(pid, procfs=str(procfs)))
    assert runtime == PythonRuntime(library, (3, 13))


def test_the_agents_temporary_directory_is_found_without_writing_to_it(tmp_path: Path) -> None:
    """tempfile.gettempdir()'s first call writes and removes a test file: an agent killed
    between the two left it in $TMPDIR (seen once in the kill tests). Cleaning stale files
    finds the directory as gettempdir would, and leaves it as it was."""
    empty = tmp_path / "agent-tmp"
    empty.mkdir()
    code = ("from dlprof_agent.reach.bootstrap_files import remove_stale_files, "
            "temporary_directory\n"
            "remove_stale_files()\n"
            "print(temporary_directory())\n")
    found = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(empty)},
                           capture_output=True, text=True, timeout=60, check=True).stdout
    assert found.strip() == str(empty)
    assert list(empty.iterdir()) == []
    unusable = {**os.environ, "TMPDIR": str(tmp_path / "missing")}
    found = subprocess.run([sys.executable, "-c", code], env=unusable, capture_output=True,
                           text=True, timeout=60, check=True).stdout
    assert found.strip() == subprocess.run(
        [sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"], env=unusable,
        capture_output=True, text=True, timeout=60, check=True).stdout.strip()
