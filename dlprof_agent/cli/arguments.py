"""Parsers for command-line values, shared by every command: a bad value is
a one-line argparse error that says what was expected."""

from __future__ import annotations

import argparse
import math
import re
import textwrap
from collections.abc import Callable
from typing import Any

from dlprof_agent.errors import ExitCode


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports errors in one line, like the rest of the agent."""

    def error(self, message: str) -> Any:
        self.exit(ExitCode.USAGE, f"dlprof-agent: error: {message} (see {self.prog} --help)\n")


def paragraph(text: str) -> str:
    """Wrap a description; the raw formatter keeps the examples' own layout."""
    return textwrap.fill(text, width=78)


def whole_number(minimum: int, maximum: int | None = None, *, unit: str = ""
                 ) -> Callable[[str], int]:
    """``unit``: what is counted ("steps"), for the messages."""
    what = f" {unit}" if unit else ""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a number of {unit}" if unit
                else f"{text!r} is not a whole number") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(
                f"{text} is out of range: give {minimum} or more{what}" if maximum is None
                else f"{text} is out of range: give {minimum} to {maximum}{what}")
        return value
    return parse


def seconds(minimum: float, maximum: float | None = None, *, above: bool = False
            ) -> Callable[[str], float]:
    """``above``: ``minimum`` itself is not allowed (more than 0 seconds)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a number of seconds (e.g. 1 or 0.5)") from None
        too_small = value <= minimum if above else value < minimum
        if not math.isfinite(value) or too_small or (maximum is not None and value > maximum):
            bound = (f"more than {minimum:g}" if above else f"at least {minimum:g}"
                     ) if maximum is None else f"{minimum:g} to {maximum:g}"
            raise argparse.ArgumentTypeError(f"{text} is out of range: give {bound} seconds")
        return value
    return parse


def budget_fraction(text: str) -> float:
    """A share of step time: ``1%`` or ``0.01`` (a bare number is a fraction)."""
    percent = text.strip().endswith("%")
    try:
        value = float(text.strip().removesuffix("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a share of step time (e.g. 1% or 0.01)") from None
    if percent:
        value /= 100
    if not math.isfinite(value) or not 0.0001 <= value <= 1:
        raise argparse.ArgumentTypeError(
            f"{text} is out of range: give 0.01% to 100% (0.0001 to 1)")
    return value


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a port: use 1-65535, or 0 for any")
    return value


def pid(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a pid: give the number `ps` or `pgrep -f train.py` shows"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a pid: pids are positive")
    return value


def regex(text: str) -> re.Pattern[str]:
    try:
        return re.compile(text)
    except re.error as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression: {error}"
                                         ) from None


def environment_pair(text: str) -> tuple[str, str]:
    name, equals, value = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE, e.g. SLURM_JOB_ID=1234")
    return name, value


def node_name(text: str) -> str:
    """A node's name for a label: printable, at most 253 characters (a DNS name,
    as Kubernetes names nodes)."""
    if not text or len(text) > 253 or not text.isprintable() or not text.isascii():
        raise argparse.ArgumentTypeError(
            f"{text[:40]!r} is not a node name: give 1 to 253 printable characters, "
            "e.g. gpu-node-7")
    return text
