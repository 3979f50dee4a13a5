"""``python -m tests.short_waits attach PID ...``: the agent's command line with the
probe channel's waits shortened, for tests that would otherwise sit out seconds of
real time (the late limit, the pause before reaching a lost probe again). The
commands take the channel's ``DEFAULT_TIMEOUTS`` as their options' default when
their modules are imported, so it is replaced before the command runs;
everything else is the agent as shipped."""

from __future__ import annotations

import dataclasses
import runpy

from dlprof_agent.probe_link import channel

# Long enough that a reply held up by a loaded machine is not taken for a late one.
LATE_LIMIT_SECONDS = 3.0
RETRY_SECONDS = (0.5, 1.0, 2.0, 4.0, 7.5, 15.0, 30.0, 75.0)  # the shipped pauses, a quarter


def shorten() -> None:
    channel.DEFAULT_TIMEOUTS = dataclasses.replace(
        channel.DEFAULT_TIMEOUTS, late_limit_seconds=LATE_LIMIT_SECONDS,
        retry_seconds=RETRY_SECONDS)


if __name__ == "__main__":
    shorten()
    runpy.run_module("dlprof_agent", run_name="__main__", alter_sys=True)
