"""Every error the package raises on purpose, in one hierarchy.

``DlprofError`` is the root. An error about a process carries its ``pid``; an
error a user can cause carries a one-line message, a hint and an exit code from
``ExitCode``, and the command line prints it without a traceback. Errors of a
vendor library or of the operating system are translated into these where they
are met (``collectors/nvml.py`` for NVML, ``probe/cupti_binding.py`` for CUPTI).

Standard library only: the probe imports this module inside the training job.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class ExitCode(enum.IntEnum):
    """What ``dlprof-agent`` exits with; ``run`` exits with its command's own code."""

    FINISHED = 0
    BUG = 1
    USAGE = 2
    NO_TARGET = 3
    ACCESS_DENIED = 4
    PORT_UNAVAILABLE = 5
    ALREADY_ATTACHED = 6
    GRAFANA = 7
    TRACE_UNAVAILABLE = 8


_EXIT_CODE_MEANINGS = {
    ExitCode.FINISHED: "finished: duration reached, Ctrl-C or SIGTERM, or the target exited",
    ExitCode.BUG: "unexpected failure: a bug; please report it with the traceback",
    ExitCode.USAGE: "bad arguments",
    ExitCode.NO_TARGET: "no such process, or it exited while the agent was starting",
    ExitCode.ACCESS_DENIED: "no permission to read the process",
    ExitCode.PORT_UNAVAILABLE: "cannot listen on the address and port",
    ExitCode.ALREADY_ATTACHED: "the process already has an agent attached through its probe",
    ExitCode.GRAFANA: "grafana: cannot reach Grafana, or it refused the credentials or a change",
    ExitCode.TRACE_UNAVAILABLE: ("trace: no probe in the process, no GPU in use, or kernel "
                                 "tracing busy or unavailable"),
}


def exit_codes_help(codes: tuple[ExitCode, ...] = tuple(ExitCode),
                    meanings: Mapping[ExitCode, str] | None = None) -> str:
    """The ``exit codes:`` paragraph of a command's ``--help``; ``meanings`` words
    a code for one command."""
    words = {**_EXIT_CODE_MEANINGS, **(meanings or {})}
    lines = [f"  {int(code)}  {words[code]}" for code in codes]
    if codes == tuple(ExitCode):
        lines.append("  run: the command's own exit code")
    return "\n".join(["exit codes:", *lines])


EXIT_CODES_HELP = exit_codes_help()


class DlprofError(Exception):
    """The root of the hierarchy: a one-line message, an optional hint, and the
    pid of the process it is about, where there is one."""

    exit_code = ExitCode.BUG

    def __init__(self, message: str, hint: str = "", *, pid: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.pid = pid

    def one_line(self) -> str:
        return f"{self.message}: {self.hint}" if self.hint else self.message


# What a user asked for.

class UsageError(DlprofError):
    exit_code = ExitCode.USAGE


class PortUnavailable(DlprofError):
    exit_code = ExitCode.PORT_UNAVAILABLE


class GrafanaError(DlprofError):
    """Grafana could not be reached, or refused the credentials or a change."""

    exit_code = ExitCode.GRAFANA


class TraceUnavailable(DlprofError):
    """No trace can be taken: no probe, no GPU in use, kernel tracing busy or unavailable."""

    exit_code = ExitCode.TRACE_UNAVAILABLE


class WebConfigError(DlprofError):
    """The ``--web.config.file`` cannot be read or is not valid."""

    exit_code = ExitCode.USAGE


class MissingLibrary(WebConfigError):
    """The web config needs an optional library that is not installed."""


# The target process.

class TargetNotFound(DlprofError):
    exit_code = ExitCode.NO_TARGET


class TargetGone(TargetNotFound):
    """The process exited after the agent found it."""

    def __init__(self, pid: int) -> None:
        super().__init__(f"process {pid} has exited", pid=pid)


class TargetAccessDenied(DlprofError):
    exit_code = ExitCode.ACCESS_DENIED


# Getting the probe into the target.

class InjectionError(DlprofError):
    """The probe could not be loaded into a running process."""


class NotPython(InjectionError):
    """The target is not a Python the probe can run in."""

    exit_code = ExitCode.USAGE


class InjectionRefused(InjectionError):
    """The kernel or the target's security settings refuse the injection."""

    exit_code = ExitCode.ACCESS_DENIED


class InjectionFailed(InjectionError):
    """The injection was tried and did not work."""


class UnknownDebugOffsets(InjectionError):
    """A 3.14+ job's _Py_DebugOffsets are not a table this agent can read (the
    message says why): another injector is tried."""


class InjectionUnsafe(InjectionFailed):
    """The injector cannot give a borrowed thread back whole on this CPU or kernel (a
    register state it cannot keep); it never injects there, and the agent goes on
    with what it reads from outside."""


class StateNotKept(DlprofError):
    """A signal frame cannot hold a thread's whole register state (``reach/frame.py``,
    ``reach/arm64.py``); the message says what and why, in a few words."""


class InjectionNotNow(InjectionFailed):
    """The target cannot take the probe at this moment; a later try may work."""


# The probe's channel.

class ProbeUnavailable(DlprofError):
    """No probe answers for this process; the message says why, in plain words."""


class ProbeBusy(ProbeUnavailable):
    """Another agent holds the probe's only connection; ``agent_pid`` where it said."""

    def __init__(self, agent_pid: int | None, *, pid: int | None = None) -> None:
        super().__init__("another agent" + (f" (pid {agent_pid})" if agent_pid else "")
                         + " is attached", pid=pid)
        self.agent_pid = agent_pid


class ProbeImpostor(ProbeUnavailable):
    """The socket is not the job's probe: another user's, or another process's."""


class ProbeStale(ProbeUnavailable):
    """The socket is there but nothing listens: its process ended or exec'd."""


class ProbeAlreadyAttached(DlprofError):
    """The user asked to attach where an agent is attached already. Not a
    ProbeUnavailable: the agent must stop here, not go on without the probe."""

    exit_code = ExitCode.ALREADY_ATTACHED


class ProtocolError(DlprofError):
    """A frame that cannot be read: bad magic, version, size or JSON."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason  # a short word, used as a metric label


class ConnectionClosed(DlprofError):
    """The other end closed the probe's connection."""

    def __init__(self, message: str = "connection closed") -> None:
        super().__init__(message)


# Vendor libraries at the hardware seams.

class NvmlUnavailable(DlprofError):
    """NVML cannot be used on this machine; ``reason`` says why and what to do."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NvmlError(DlprofError):
    """An NVML call failed for a reason other than "not supported"."""

    def __init__(self, function: str, message: str, code: int | None = None) -> None:
        super().__init__(f"{function}: {message}")
        self.function = function
        self.code = code


class GpuLost(NvmlError):
    """NVML reports the GPU lost (fallen off the bus, Xid 79); it stays so until reset."""


class CuptiUnavailable(DlprofError):
    """CUPTI cannot be used in this process; ``reason`` says why in a few words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CuptiBusy(CuptiUnavailable):
    """Another CUPTI client holds the process; ``reason`` names it where known."""
