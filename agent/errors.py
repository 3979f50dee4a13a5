"""Errors a user can meet. Each carries a one-line message, a hint and an exit code;
the command line prints them without a traceback."""

from __future__ import annotations


class AgentError(Exception):
    exit_code = 1

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        return f"{self.message}: {self.hint}" if self.hint else self.message


class UsageError(AgentError):
    exit_code = 2


class TargetNotFound(AgentError):
    exit_code = 3


class TargetAccessDenied(AgentError):
    exit_code = 4


class PortUnavailable(AgentError):
    exit_code = 5


class GrafanaError(AgentError):
    """Grafana could not be reached, or refused the credentials or a change."""

    exit_code = 7


class TraceUnavailable(AgentError):
    """No trace can be taken: no probe, no GPU in use, kernel tracing busy or unavailable."""

    exit_code = 8


EXIT_CODES_HELP = """exit codes:
  0  finished: duration reached, Ctrl-C, or the target exited
  1  unexpected failure: a bug; please report it with the traceback
  2  bad arguments
  3  no such process, or it exited while the agent was starting
  4  no permission to read the process
  5  cannot listen on the address and port
  6  the process already has an agent attached through its probe
  7  grafana: cannot reach Grafana, or it refused the credentials or a change
  8  trace: no probe in the process, no GPU in use, or kernel tracing busy or unavailable
  run: the command's own exit code"""
