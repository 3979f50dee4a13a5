"""``python -m dlprof_agent`` is the same as the ``dlprof-agent`` command."""

from __future__ import annotations

import os
import signal
from types import FrameType


def _stopped_before_start(signum: int, frame: FrameType | None) -> None:
    # Nothing has been started yet (the commands are still being imported): leave
    # as a stop does later, with its one line and exit code, instead of dying by it.
    os.write(2, b"dlprof-agent: stopped by SIGTERM\n")
    os._exit(0)


signal.signal(signal.SIGTERM, _stopped_before_start)

from dlprof_agent.cli.main import entry  # noqa: E402  (after the handler, on purpose)

entry()
