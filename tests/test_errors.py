"""One error hierarchy: every deliberate error is a DlprofError defined in
dlprof_agent/errors.py, and every exit code comes from ExitCode."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from dlprof_agent import errors
from dlprof_agent.errors import (
    EXIT_CODES_HELP,
    DlprofError,
    ExitCode,
    ProbeAlreadyAttached,
    ProbeBusy,
    ProbeUnavailable,
    TargetGone,
    TargetNotFound,
    exit_codes_help,
)

PACKAGE = Path(errors.__file__).parent

# Exceptions defined elsewhere on purpose, each with why it is not part of the hierarchy.
SIGNALS_NOT_ERRORS = {
    "StopRequested",  # agent/loop.py: SIGTERM, a BaseException like KeyboardInterrupt
    "ReplyLate",  # probe_link/client.py: "no reply yet", a TimeoutError the channel retries
    "NoProbe",  # probe_link/connect.py: why there is no probe, turned into a message there
    "_NeverRaised",  # collectors/nvml.py: a placeholder for an optional pynvml class
    # The reference workloads run as jobs without the agent; the CLI turns these into
    # UsageError (cli/workload_run.py).
    "DatasetError",
    "SweepError",
}


def _error_classes() -> list[type[BaseException]]:
    return [value for value in vars(errors).values()
            if inspect.isclass(value) and issubclass(value, BaseException)]


def test_every_error_of_the_module_is_a_dlprof_error_with_a_known_exit_code() -> None:
    classes = _error_classes()
    assert len(classes) >= 25
    for error in classes:
        assert issubclass(error, DlprofError), error
        assert isinstance(error.exit_code, ExitCode), error


def test_no_other_module_defines_an_exception_outside_the_hierarchy() -> None:
    strays = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "errors.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or node.name in SIGNALS_NOT_ERRORS:
                continue
            bases = {ast.unparse(base) for base in node.bases}
            if any(base.endswith(("Error", "Exception")) for base in bases) \
                    and not any(base.startswith(("Dlprof", "errors.")) for base in bases):
                strays.append(f"{path.relative_to(PACKAGE)}: {node.name}({', '.join(bases)})")
    assert not strays, "\n".join(strays)


def test_help_lists_every_exit_code_once() -> None:
    lines = EXIT_CODES_HELP.splitlines()
    assert lines[0] == "exit codes:"
    numbers = [line.split()[0] for line in lines[1:]]
    assert numbers == [str(int(code)) for code in ExitCode] + ["run:"]
    assert exit_codes_help((ExitCode.FINISHED,), {ExitCode.FINISHED: "done"}) == (
        "exit codes:\n  0  done")


def test_errors_about_a_process_carry_its_pid() -> None:
    gone = TargetGone(4242)
    assert gone.pid == 4242 and gone.one_line() == "process 4242 has exited"
    assert isinstance(gone, TargetNotFound) and gone.exit_code == ExitCode.NO_TARGET
    busy = ProbeBusy(77, pid=4242)
    assert busy.pid == 4242 and busy.agent_pid == 77 and "pid 77" in busy.message
    assert DlprofError("message", "hint", pid=1).one_line() == "message: hint"


@pytest.mark.parametrize("error", [ProbeAlreadyAttached("attached")])
def test_refusals_that_must_stop_the_agent_are_not_probe_unavailable(error: Exception) -> None:
    # The channel goes on without the probe on ProbeUnavailable; an agent already
    # attached must instead stop the command with its own exit code.
    assert not isinstance(error, ProbeUnavailable)
    assert isinstance(error, DlprofError) and error.exit_code == ExitCode.ALREADY_ATTACHED
