"""The script file ``sys.remote_exec`` hands the target, and the cleanup of what an
agent killed during an injection left in a temporary directory. ``sys.remote_exec``
takes a file the *target* opens, so the code goes to a file in the target's own
``/tmp`` (reached through ``/proc/<pid>/root``, which also works across mount
namespaces)."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import secrets
import stat
import tempfile
import threading
import time

from dlprof_agent.collectors.target import Target
from dlprof_agent.reach.procfs import inside_root_path

BOOTSTRAP_FILE_SECONDS = 120.0  # how long a remote_exec script stays on disk
# Where tempfile.gettempdir() looks, in its order, before the working directory.
_TEMP_VARIABLES = ("TMPDIR", "TEMP", "TMP")
_TEMP_DIRECTORIES = ("/tmp", "/var/tmp", "/usr/tmp")


def temporary_directory() -> str:
    """The agent's temporary directory, as tempfile chooses it but without writing:
    gettempdir's first call creates and removes a test file there, which an agent
    killed in between (as the kill tests do, at random moments) leaves behind."""
    if tempfile.tempdir is not None:
        return tempfile.tempdir
    candidates = [os.environ.get(name) for name in _TEMP_VARIABLES]
    for candidate in (*candidates, *_TEMP_DIRECTORIES):
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK | os.X_OK):
            return os.path.abspath(candidate)
    return os.getcwd()


class Bootstrap:
    """A script file the target will open, and its removal.

    Kept by a directory descriptor on the /tmp that holds it, so removal still works
    after the target has exited and its /proc/<pid>/root is gone.
    """

    def __init__(self, tmp: str, seen_as_tmp: str, code: str,
                 job: Target | None = None) -> None:
        self._tmp_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
        self._lock = threading.Lock()
        try:
            # The agent's pid in the name: a later agent removes it once this one is
            # gone. The target's pid and start time: not while a job that may still
            # take it (a main thread that waits, hours maybe) lives.
            for_target = f"{job.pid}.{job.start_ticks}-" if job is not None else ""
            self._name = (f"dlprof-bootstrap-{os.getpid()}-{for_target}"
                          f"{secrets.token_hex(8)}")
            os.mkdir(self._name, 0o700, dir_fd=self._tmp_fd)
            # The target may run as another user: it may open the file, nobody may list.
            os.chmod(self._name, 0o711, dir_fd=self._tmp_fd)
            script = os.open(f"{self._name}/bootstrap.py",
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                             dir_fd=self._tmp_fd)
            with open(script, "w", encoding="utf-8") as file:
                file.write(code)
                os.fchmod(file.fileno(), 0o644)
        except BaseException:
            self.remove()
            raise
        self.seen_as = f"{seen_as_tmp.rstrip('/')}/{self._name}/bootstrap.py"

    def remove(self) -> None:
        with self._lock:
            if self._tmp_fd < 0:
                return
            for path, remove in ((f"{self._name}/bootstrap.py", os.unlink),
                                 (self._name, os.rmdir)):
                with contextlib.suppress(OSError):
                    remove(path, dir_fd=self._tmp_fd)
            os.close(self._tmp_fd)
            self._tmp_fd = -1


def write_bootstrap(target: Target, code: str, *, outlive_agent: bool = False
                    ) -> Bootstrap:
    """Write ``code`` to a file the target can open (at ``.seen_as``).

    Prefers the target's own /tmp, reached through /proc/<pid>/root, so a job in another
    container sees the file; falls back to the agent's temporary directory. With
    ``outlive_agent``, the file outlives a killed agent as long as the job does.
    """
    job = target if outlive_agent else None
    try:
        return Bootstrap(inside_root_path(target.pid, "/tmp", procfs=target.procfs), "/tmp",
                         code, job)
    except OSError:
        local = temporary_directory()
        return Bootstrap(local, local, code, job)


def remove_later(bootstrap: Bootstrap, seconds: float) -> None:
    # remote_exec returns before the target has read the file; give it time to reach a
    # safe point, and clean up at exit should the agent stop sooner.
    timer = threading.Timer(seconds, bootstrap.remove)
    timer.daemon = True
    timer.start()
    atexit.register(bootstrap.remove)


_BOOTSTRAP_DIR = re.compile(r"dlprof-bootstrap-(?:(\d+)-)?(?:(\d+)\.(\d+)-)?[0-9a-f]{16}")
_OLD_GDB_SCRIPT = re.compile(r"tmp[a-z0-9_]{8}\.gdb")  # written by agents before 0.x
_OLD_GDB_SCRIPT_SIGN = b"echo dlprof-agent: probe bootstrap ran"
_OLD_GDB_SCRIPT_SECONDS = 60.0  # those agents removed theirs within 20 s


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _job_alive(pid: int, start_ticks: int) -> bool:
    return Target(pid, start_ticks).is_running()


def _remove_stale_in(tmp: str, now: float) -> list[str]:
    """Remove, from directory ``tmp``, bootstrap folders and gdb scripts that an agent
    killed mid-injection left: only ours (our uid, no symbolic links), only once the
    agent named in them is gone and the job has had BOOTSTRAP_FILE_SECONDS to read them,
    or, where the folder names its job, once that job is gone: a remote-debugging
    script stays queued in the job until its main thread next runs Python, and a job
    that then found no file would say so on its stderr."""
    removed: list[str] = []
    try:
        tmp_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return removed
    try:
        for name in os.listdir(tmp_fd):
            folder = _BOOTSTRAP_DIR.fullmatch(name)
            if folder is None and _OLD_GDB_SCRIPT.fullmatch(name) is None:
                continue
            try:
                info = os.stat(name, dir_fd=tmp_fd, follow_symlinks=False)
            except OSError:
                continue
            if info.st_uid != os.geteuid():
                continue
            age = now - info.st_mtime
            if folder is not None:
                owner, job, job_start = folder.groups()
                if (not stat.S_ISDIR(info.st_mode) or age < BOOTSTRAP_FILE_SECONDS
                        or (owner is not None and _pid_alive(int(owner)))
                        or (job is not None and _job_alive(int(job), int(job_start)))):
                    continue
                with contextlib.suppress(OSError):
                    os.unlink(f"{name}/bootstrap.py", dir_fd=tmp_fd)
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=tmp_fd)
                    removed.append(name)
            elif stat.S_ISREG(info.st_mode) and age >= _OLD_GDB_SCRIPT_SECONDS:
                try:
                    script = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=tmp_fd)
                except OSError:
                    continue
                with open(script, "rb") as file:
                    ours = _OLD_GDB_SCRIPT_SIGN in file.read(4096)
                if ours:
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=tmp_fd)
                        removed.append(name)
    finally:
        os.close(tmp_fd)
    return removed


def remove_stale_files(target: Target | None = None, *, now: float | None = None
                       ) -> list[str]:
    """Clean what agents killed during an injection left in the temporary directory
    (and in the /tmp of the target, which may be another container's). Safe to
    call any time: it removes only files of dead agents. Returns the names removed."""
    when = time.time() if now is None else now
    places = [temporary_directory()]
    if target is not None:
        places.append(inside_root_path(target.pid, "/tmp", procfs=target.procfs))
    seen: set[tuple[int, int]] = set()
    removed: list[str] = []
    for place in places:
        try:
            info = os.stat(place)
        except OSError:
            continue
        if (info.st_dev, info.st_ino) not in seen:
            seen.add((info.st_dev, info.st_ino))
            removed += _remove_stale_in(place, when)
    return removed
