"""Runs the bootstrap with ``sys.remote_exec`` (Python 3.14+, when the target runs the
agent's own Python version): the interpreter itself runs the file at its next safe
point, so no debugger touches the job."""

from __future__ import annotations

from collections.abc import Callable

from dlprof_agent.collectors.target import Target
from dlprof_agent.errors import InjectionFailed, TargetNotFound
from dlprof_agent.reach.bootstrap_files import (
    BOOTSTRAP_FILE_SECONDS,
    remove_later,
    write_bootstrap,
)
from dlprof_agent.reach.refusal import refused


def inject_with_remote_exec(target: Target, code: str,
                            remote_exec: Callable[[int, str], object]) -> None:
    """``remote_exec`` is ``sys.remote_exec`` (a stand-in in tests)."""
    pid = target.pid
    try:
        bootstrap = write_bootstrap(target, code)
    except OSError as error:
        raise InjectionFailed(f"cannot write the bootstrap script: {_first_line(error)}",
                              "make a temporary directory writable (TMPDIR)", pid=pid) from None
    remove_later(bootstrap, BOOTSTRAP_FILE_SECONDS)
    try:
        remote_exec(pid, bootstrap.seen_as)
    except ProcessLookupError:
        raise TargetNotFound(f"process {pid} exited before the probe could be injected",
                             "attach to a running job", pid=pid) from None
    except PermissionError:
        raise refused(target, "sys.remote_exec was denied") from None
    except (OSError, RuntimeError, ValueError) as error:
        raise InjectionFailed(f"sys.remote_exec into process {pid} failed: {_first_line(error)}",
                              "the job must not disable remote debugging "
                              "(PYTHON_DISABLE_REMOTE_DEBUG, -X disable-remote-debug)",
                              pid=pid) from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0].rstrip(".") if text else type(error).__name__
