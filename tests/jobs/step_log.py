"""The trainers' own step timer, shared by the jobs of tests/test_trainers.py:
a callback of each trainer calls ``StepLog.step_ended()`` at every step's end,
which appends the time and the probe's own step count at that moment to the
log, so that a test compares the probe with the job over the same steps."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any


def arguments(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--step-log", required=True, help="JSON lines: the job's step ends")
    parser.add_argument("--until", required=True, metavar="FILE",
                        help="stop after the step during which FILE appears")
    parser.add_argument("--max-seconds", type=float, default=300.0,
                        help="stop after this long in any case")
    parser.add_argument("--batch", type=int, default=16)
    return parser


def enable_probe() -> None:
    """The probe, dormant until an agent attaches (what the tier measures is the
    probe's timing, not how it was loaded: injection has its own tests)."""
    import dlprof_agent.probe
    from dlprof_agent.probe import runtime

    if runtime.launch_requested(os.environ):
        return  # DLPROF_PROBE=1: started at launch, before this script, or not at all
    dlprof_agent.probe.enable()


def probe_steps() -> int | None:
    """Steps the probe has counted so far in this job, None without an agent."""
    from dlprof_agent.probe import runtime

    probe: Any = runtime.current()
    session = getattr(probe, "session", None)
    return None if session is None else sum(session.recorder.steps.values())


class StepLog:
    def __init__(self, args: argparse.Namespace, trainer: str) -> None:
        self.until = args.until
        self.deadline = time.monotonic() + args.max_seconds
        self.steps = 0
        self._file = open(args.step_log, "w")  # noqa: SIM115 - open for the job's life
        self._write({"pid": os.getpid(), "trainer": trainer, "batch": args.batch})

    def step_ended(self) -> bool:
        """Call at each step's end; True when the job should stop."""
        self._write({"step": self.steps, "end": time.perf_counter(),
                     "probe_steps": probe_steps()})
        self.steps += 1
        return os.path.exists(self.until) or time.monotonic() > self.deadline

    def done(self, **facts: Any) -> None:
        self._write({"done": True, **facts})
        self._file.close()

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
