"""The Target value: a pid with its start time, checked against reuse in one place."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest

from dlprof_agent.collectors.target import Target, open_target
from dlprof_agent.errors import TargetGone, TargetNotFound, UsageError


def test_a_target_is_its_pid_and_start_time_until_it_exits(
        python_sleeper: subprocess.Popen[bytes]) -> None:
    target = open_target(python_sleeper.pid)
    assert target == Target.of(python_sleeper.pid)  # the same start time, read twice
    assert target.is_running() and str(target) == f"process {python_sleeper.pid}"
    assert target.name().startswith("python")
    python_sleeper.kill()
    python_sleeper.wait()
    assert not target.is_running()
    with pytest.raises(TargetGone):
        Target.of(python_sleeper.pid)


def test_a_reused_pid_is_another_target(python_sleeper: subprocess.Popen[bytes]) -> None:
    now = Target.of(python_sleeper.pid)
    earlier = replace(now, start_ticks=now.start_ticks - 1)
    assert not earlier.is_running()


def test_a_zombie_is_reported_as_exited() -> None:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    try:
        with pytest.raises(TargetNotFound, match="has exited"):
            open_target(process.pid)
    finally:
        process.wait()


@pytest.mark.parametrize("pid", ["0", "-3", "own"])
def test_a_pid_that_is_no_job_is_a_usage_error(pid: str) -> None:
    with pytest.raises(UsageError):
        open_target(os.getpid() if pid == "own" else int(pid))
