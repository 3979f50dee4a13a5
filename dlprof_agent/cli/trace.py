"""`dlprof-agent trace PID --steps N`: the next N training steps of a GPU job as a
Chrome/Perfetto timeline, from the in-process probe's CUPTI tracer.

The probe keeps the window's kernels, memsets and copies (one track per GPU and
stream), the layers' forward and backward ranges and the step boundaries, then
goes back to aggregating. This side waits, shows progress on stderr, fetches
the records in chunks and writes the trace event JSON. It works beside an agent
already attached to the job (`attach`, the node daemon) as well as alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from dlprof_agent import __version__
from dlprof_agent.cli.arguments import pid, seconds, whole_number
from dlprof_agent.collectors.target import open_target
from dlprof_agent.errors import (
    EXIT_CODES_HELP,
    ConnectionClosed,
    ExitCode,
    ProtocolError,
    TraceUnavailable,
    UsageError,
)
from dlprof_agent.exporters import chrome_trace as trace_writer
from dlprof_agent.probe_link.client import ProbeClient, ReplyLate
from dlprof_agent.probe_link.connect import ProbeOptions, open_trace_channel

POLL_SECONDS = 0.5
DEFAULT_STEPS = 10
MAX_STEPS = 100_000  # the probe's own limit (probe.session.MAX_TRACE_STEPS)
DEFAULT_TIMEOUT_SECONDS = 300.0
PAYLOAD_SECONDS = 30.0  # the probe builds the window's records once: allow it that long

HINTS = (
    ("no GPU in use", "trace a job that trains on a GPU"),
    ("cupti-python not installed",
     "pip install 'cupti-python==12.*' (or ==13.*, the CUDA major of the job's framework) "
     "into the job's environment, then restart the job"),
    ("cupti-python", "install the cupti-python that matches the job's CUDA major"),
    ("tracing busy", "stop the other profiler or trace (torch.profiler, Nsight) and try again"),
    ("is running", "stop the other profiler (torch.profiler, Nsight) and try again"),
    ("held by", "stop the other profiler (torch.profiler, Nsight) and try again"),
    ("unknown command", "the job's probe predates traces: restart it with this dlprof-agent"),
    ("steps before the time limit", "ask for fewer --steps, or a longer --timeout"),
    ("no training step", "the probe sees no steps: is the job training? (docs/probe.md, steps)"),
)


def add_parser(commands: Any, pid_type: Callable[[str], int] = pid) -> None:
    trace = commands.add_parser(
        "trace", help="capture N steps of a GPU job's kernels and layers as a timeline",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Capture the next N training steps of PID with the in-process probe's "
                    "CUPTI tracer:\nkernels, memsets and memcpys on one track per GPU and "
                    "stream, the layers'\nforward and backward ranges, and the step "
                    "boundaries, into a Chrome trace\nevent file for ui.perfetto.dev or "
                    "chrome://tracing. Continuous aggregation goes\non afterwards. Works "
                    "beside an agent already attached to the job.",
        epilog="examples:\n"
               "  dlprof-agent trace 4242\n"
               "  dlprof-agent trace 4242 --steps 3 -o step.json\n"
               "  dlprof-agent trace $(pgrep -f train.py) --steps 20 --timeout 600\n\n"
               "The job needs cupti-python of its CUDA major in its own environment.\n\n"
               + EXIT_CODES_HELP)
    trace.add_argument("pid", type=pid_type, metavar="PID", help="the training job's process id")
    trace.add_argument("--steps", type=whole_number(1, MAX_STEPS, unit="steps"),
                       default=DEFAULT_STEPS, metavar="N",
                       help=f"steps to capture (default {DEFAULT_STEPS})")
    trace.add_argument("-o", "--output", metavar="FILE",
                       help="where to write the trace (default trace-PID.json)")
    trace.add_argument("--timeout", type=seconds(1, 86400), default=DEFAULT_TIMEOUT_SECONDS,
                       metavar="SECONDS", help="give up when the steps have not come by then "
                                               f"(default {DEFAULT_TIMEOUT_SECONDS:g})")
    trace.add_argument("--no-layers", dest="layers", action="store_false",
                       help="no layer ranges (when no agent is attached, the probe times "
                            "layers for the trace by default)")
    trace.add_argument("--no-inject", dest="inject", action="store_false",
                       help="never inject the probe; use one only if the job started it")


def _fail(message: str) -> TraceUnavailable:
    for needle, hint in HINTS:
        if needle in message:
            return TraceUnavailable(message, hint)
    return TraceUnavailable(message)


class _Progress:
    """One line on stderr: rewritten in place on a terminal, else printed on change."""

    def __init__(self, err: TextIO, pid: int) -> None:
        self._err = err
        self._pid = pid
        self._tty = err.isatty()
        self._last = ""

    def show(self, text: str) -> None:
        if text == self._last:
            return
        self._last = text
        line = f"dlprof-agent: tracing pid {self._pid}: {text}"
        if self._tty:
            self._err.write("\r\x1b[K" + line)
        else:
            self._err.write(line + "\n")
        self._err.flush()

    def done(self) -> None:
        if self._tty and self._last:
            self._err.write("\n")
            self._err.flush()


def _request(client: ProbeClient, command: str, args: dict[str, Any]) -> dict[str, Any]:
    try:
        return client.request(command, args)
    except ReplyLate:
        # The job held its GIL; the reply comes on the next read.
        return {"ok": True, "phase": "late"}
    except (OSError, ConnectionClosed, ProtocolError) as error:
        raise TraceUnavailable(f"lost the probe: {str(error) or 'it closed the connection'}",
                               "the job exited, or the agent it served beside detached"
                               ) from None


def _wait_for_layer_hooks(client: ProbeClient, progress: _Progress, deadline: float) -> None:
    """Our own session just put the hooks in: the probe finds the model over two
    steps and only then times layers. Start the window after that."""
    while time.monotonic() < deadline:
        reply = _request(client, "snapshot", {})
        steps = reply.get("probe", {}).get("steps", {}) if reply.get("ok") else {}
        if sum(int(count) for count in steps.values()) >= 2:
            return
        progress.show("waiting for the probe to find the model")
        time.sleep(POLL_SECONDS)


def capture(client: ProbeClient, first_reply: dict[str, Any] | None, steps: int,
            timeout: float, progress: _Progress) -> dict[str, Any]:
    """Run one trace window through ``client``; the probe's payload."""
    arguments = {"steps": steps, "max_seconds": timeout}
    reply = first_reply if first_reply is not None else _request(client, "trace", arguments)
    if not reply.get("ok"):
        raise _fail(str(reply.get("error", "the probe refused")))
    if first_reply is not None and not reply.get("layers"):
        progress.show("no layer ranges: the attached agent runs without --layers")
    deadline = time.monotonic() + timeout + PAYLOAD_SECONDS
    while True:
        status = _request(client, "trace_status", {"offset": 0})
        phase = status.get("phase")
        if not status.get("ok"):
            raise _fail(str(status.get("error", "the trace failed")))
        if phase == "done":
            break
        if phase == "waiting":
            progress.show("waiting for the next step")
        elif phase == "recording":
            progress.show(f"step {status.get('steps', 0)} of {steps}")
        elif phase == "collecting":
            progress.show(f"{steps} steps; collecting the GPU's records")
        if time.monotonic() > deadline:
            raise _fail(f"only {status.get('steps', 0)} of {steps} steps before the time limit")
        time.sleep(POLL_SECONDS)
    size = int(status.get("size", 0))
    chunks = [str(status.get("data", ""))]
    received = len(chunks[0])
    while received < size:
        part = _request(client, "trace_status", {"offset": received})
        data = str(part.get("data", ""))
        if not part.get("ok") or not data:
            raise _fail(str(part.get("error", "the trace's records stopped coming")))
        chunks.append(data)
        received += len(data)
        progress.show(f"fetching the records ({received * 100 // max(size, 1)}%)")
    payload: dict[str, Any] = json.loads("".join(chunks))
    return payload


def trace_command(args: argparse.Namespace, out: TextIO = sys.stdout,
                  err: TextIO = sys.stderr) -> int:
    process = open_target(args.pid)
    output = args.output or f"trace-{args.pid}.json"
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK) or os.path.isdir(output):
        raise UsageError(f"cannot write {output}", "give a writable file path with -o")
    options = ProbeOptions(inject=args.inject, layers=args.layers)
    arguments = {"steps": args.steps, "max_seconds": args.timeout}
    client, first_reply = open_trace_channel(process, options, arguments)
    own = first_reply is None
    progress = _Progress(err, args.pid)
    try:
        client.set_timeout(PAYLOAD_SECONDS)
        if own and args.layers:
            _wait_for_layer_hooks(client, progress, time.monotonic() + args.timeout)
        payload = capture(client, first_reply, args.steps, args.timeout, progress)
    finally:
        progress.done()
        if own:
            client.stop()  # our session: the probe removes its hooks
        else:
            client.close()
    name = process.name() or "python"
    trace = trace_writer.chrome_trace(payload, pid=args.pid,
                                      process_name=f"{name} (pid {args.pid})",
                                      version=__version__)
    trace_writer.write(trace, output)
    counts = trace_writer.summary(trace)
    note = " (truncated: the window held more records than a trace keeps)" \
        if payload.get("truncated") else ""
    print(f"wrote {output}: {args.steps} steps, {counts.get('kernel', 0)} kernels, "
          f"{counts.get('memset', 0)} memsets, {counts.get('memcpy', 0)} copies, "
          f"{counts.get('layer', 0)} layer ranges{note}; open it in https://ui.perfetto.dev",
          file=out)
    return ExitCode.FINISHED


def run(args: argparse.Namespace) -> int:
    return trace_command(args, sys.stdout, sys.stderr)
